"""A Qwen3.5 checkpoint with an INT8-packed embedding under PP=2 (issue #6 item 4): the plugin's
``qwen3-next-embed-quant-config`` gives the embeddings the model's quant_config, so the packed
table loads and looks up the same vectors as the dense one; stock vLLM refuses to load it.

Checkpoints: gpu_models.write_embed_checkpoints (small-hybrid with MTP, seeded weights, the same
table packed and dense). Every arm pins the 4/4 split and turns split-K GEMMs off."""

from __future__ import annotations

import functools
import re

import pytest

import gpu_models as gm
import gpu_tokens as tok
from gpu_runs import EMBEDQ_ENV
from gpu_runs import embedq_kwargs as engine_kwargs
from gpu_runs import embedq_prompts as prompts
from gpu_harness import (FIRST_GDN_BOOT_S, assert_applied, assert_ran, gpu_out, grep, needs_pair, pair_env,  # noqa: F401
                         patches_in_force, run_llm, tail)

PATCH = "qwen3-next-embed-quant-config"
EMBED_METHOD = "CompressedTensorsEmbeddingWNA16Int"
MAX_TOKENS = 32
# vLLM's AutoWeightsLoader (model_executor/models/utils.py) on stock's dense table.
STOCK_REFUSAL = r"There is no module or parameter named '[\w.]*embed_tokens\.weight_(?:packed|scale|shape)'"


def embed_facts(module) -> dict:
    params = list(module.named_parameters())
    method = getattr(module, "quant_method", None)
    return {"quant_method": type(method).__name__ if method is not None else None,
            "bytes": sum(p.numel() * p.element_size() for _, p in params),
            "has_weight": any(n == "weight" for n, _ in params)}


def probe_embeddings(worker) -> dict:
    import torch
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    target = runner.model
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    embed = language.model.embed_tokens
    facts = {"pp_rank": get_pp_group().rank_in_group, "target": embed_facts(embed)}
    vocab = worker.vllm_config.model_config.get_vocab_size()
    with torch.inference_mode():  # the whole table as this rank looks it up (the Triton kernel when packed)
        table = embed(torch.arange(vocab, device=torch.device("cuda", torch.cuda.current_device())))
    facts["lookup_sha256"] = gm.table_sha256(table)
    drafter = getattr(getattr(runner, "speculator", None) or getattr(runner, "drafter", None), "model", None)
    if drafter is not None:
        d_embed = drafter.model.embed_tokens
        facts["drafter_embed"] = embed_facts(d_embed)
        facts["drafter_embed_is_target_embed"] = d_embed is embed
    return facts


def generate_and_probe(llm, probe: bool = True) -> dict:
    import sys

    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
    res = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
           "logprobs": [tok.token_logprobs(o.outputs[0]) for o in outs]}
    if probe:
        res["workers"] = sorted(llm.collective_rpc(probe_embeddings, timeout=60), key=lambda w: w["pp_rank"])
    return res


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    dirs = gm.write_embed_checkpoints(tmp_path_factory.mktemp("embedq"))
    return dirs, gm.embed_expected(dirs)


@needs_pair()
@pytest.mark.timeout(FIRST_GDN_BOOT_S + 400)
def test_packed_embedding_under_pp2(checkpoints, gpu_out, record_property):
    dirs, expected = checkpoints
    q = run_llm(engine_kwargs(dirs["quantized"], "dualgpu"), generate_and_probe, log=gpu_out / "plugin-quantized.log",
                timeout=FIRST_GDN_BOOT_S, env={**EMBEDQ_ENV, **pair_env()})
    assert_ran(q)
    assert [len(o) for o in q["outputs"]] == [MAX_TOKENS] * len(prompts()), "the quantized arm did not generate"
    assert [w["pp_rank"] for w in q["workers"]] == [0, 1]
    record_property("embedding bytes per rank (packed / bf16 table)",
                    f"{[w['target']['bytes'] for w in q['workers']]} / {expected['bf16_table_bytes']}")
    for w in q["workers"]:
        t = w["target"]
        assert t["quant_method"] == EMBED_METHOD and t["has_weight"] is False, f"rank {w['pp_rank']}: {t}"
        assert t["bytes"] == expected["embedding_bytes"], f"rank {w['pp_rank']} holds {t['bytes']} B"
        assert w["lookup_sha256"] == expected["dense_table_sha256"], f"rank {w['pp_rank']}'s lookup differs from the dense table"
    last = q["workers"][-1]
    assert last["drafter_embed_is_target_embed"] is True and last["drafter_embed"]["quant_method"] == EMBED_METHOD
    assert_applied(q["log"], "worker", patches_in_force((PATCH,)), at_least=2)
    d = run_llm(engine_kwargs(dirs["dense"], "dualgpu"), functools.partial(generate_and_probe, probe=False),
                log=gpu_out / "plugin-dense.log", timeout=200, env={**EMBEDQ_ENV, **pair_env()})
    assert_ran(d)
    c = tok.compare(d["outputs"], q["outputs"], d["logprobs"], q["logprobs"], strict=True)
    assert c["ok"], f"quantized vs dense: {c['identical']}/{c['prompts']} identical; first {c['mismatches'][:1]}"


@needs_pair()
@pytest.mark.timeout(300)
def test_stock_refuses_the_packed_embedding(checkpoints, gpu_out):
    dirs, _ = checkpoints
    s = run_llm(engine_kwargs(dirs["quantized"], "mp"), None, log=gpu_out / "stock-quantized.log", timeout=200, env=EMBEDQ_ENV)
    assert "boot_s" not in s, "stock vLLM loaded the packed embedding"
    assert grep(s["log"], STOCK_REFUSAL) or re.search(STOCK_REFUSAL, s.get("error", "")), tail(s["log"])
