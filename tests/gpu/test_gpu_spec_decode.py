"""Speculative decoding under PP=2 through the plugin (issue #6), on the spec-hybrid Qwen3.5 model
(6 Gated DeltaNet + 2 attention layers, one MTP layer; dummy weights).

MTP: generates (the long prompt twice: a prefix-cache hit through the GDN layers); the drafter
lives on the last rank only and uses the target's embedding module; every worker sees
``max_concurrent_batches == 2``; the engine and workers applied their issue #6 patches.
EAGLE3 (a one-layer Llama drafter, gpu_models.EAGLE3_CONFIG): generates; the drafter on the last
rank only; both decoders relay the auxiliary states; the rank lines list the device-phase
patches. Stock vLLM ("mp") with the same EAGLE3 config refuses in its workers with vLLM's message.
The engine configs of all three are built on the CPU in tests/integration/test_gpu_run_configs.py.
"""

from __future__ import annotations

import os
import re

import pytest

import gpu_models as gm
from gpu_runs import spec_kwargs as engine_kwargs
from gpu_runs import spec_prompts as prompts
from gpu_harness import assert_applied, assert_ran, gpu_out, grep, needs_pair, pair_env, run_llm, tail  # noqa: F401

ENGINE_PATCHES = ("pp-inflight-batches",)
WORKER_PATCHES = ("pp-inflight-batches", "drafter-shares-target-embed")
EAGLE3_WORKER_PATCHES = ("pp-inflight-batches", "qwen3-next-aux-hidden-flag")
DEVICE_PATCHES = ("qwen3-next-aux-hidden-relay", "qwen3-5-aux-hidden-layers")
DEVICE_PHASE_KEY = "patched once the device was set"
STOCK_REFUSAL = r"(\w+) does not support eagle3 with pipeline parallelism"


def probe_worker(worker) -> dict:
    """In each worker (collective_rpc): what only the worker can see."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    target = runner.model
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    facts = {"pp_rank": get_pp_group().rank_in_group, "max_concurrent_batches": worker.vllm_config.max_concurrent_batches}
    holder = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)  # V2 / V1 runner
    drafter = getattr(holder, "model", None)
    if drafter is not None:
        t_embed = getattr(getattr(language, "model", None), "embed_tokens", None)
        d_embed = getattr(getattr(drafter, "model", None), "embed_tokens", None)
        facts["drafter"] = type(drafter).__name__
        facts["drafter_embed_is_target_embed"] = d_embed is not None and d_embed is t_embed
    decoder = getattr(language, "model", None)
    aux = tuple(getattr(decoder, "aux_hidden_state_layers", ()) or ())
    if aux:  # EAGLE3: what the target captures and relays on this rank
        facts["aux_hidden_state_layers"] = list(aux)
        facts["supports_aux_hidden_states_over_pp"] = bool(getattr(decoder, "supports_aux_hidden_states_over_pp", False))
        facts["aux_slot_base"] = getattr(decoder, "_aux_slot_base_cached", None)
        facts["start_layer"] = getattr(decoder, "start_layer", None)
    return facts


def generate_and_probe(llm) -> dict:
    import sys

    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import this file
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, detokenize=False)
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": ps[-1]}], sp, use_tqdm=False)[0]
    res = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
           "repeat_cached": again.num_cached_tokens, "repeat_output": list(again.outputs[0].token_ids),
           "workers": sorted(llm.collective_rpc(probe_worker, timeout=60), key=lambda w: w["pp_rank"])}
    try:
        res["spec_metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
    except Exception as exc:  # informational
        res["spec_metrics"] = repr(exc)
    return res


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return gm.write_config_only(gm.SPEC_HYBRID, d / "model"), gm.write_config_only(gm.EAGLE3_CONFIG, d / "drafter-eagle3")


def assert_generated(res: dict) -> None:
    assert_ran(res)
    assert len(res["outputs"]) == len(prompts()) and all(len(o) == 48 for o in res["outputs"]), res["outputs"]
    assert [w["pp_rank"] for w in res["workers"]] == [0, 1], f"ranks probed: {res['workers']}"
    first, last = res["workers"]
    assert "drafter" in last and "drafter" not in first, f"the drafter is not on the last rank only: {res['workers']}"


@needs_pair()
@pytest.mark.timeout(300)
def test_mtp_under_pp2(spec_models, gpu_out, record_property):
    res = run_llm(engine_kwargs(spec_models[0]), generate_and_probe, log=gpu_out / "mtp.log", timeout=240,
                  env=pair_env())
    assert_generated(res)
    record_property("boot_s", res["boot_s"])
    record_property("spec_metrics", res["spec_metrics"])
    last = res["workers"][-1]
    assert last["drafter_embed_is_target_embed"] is True, "the MTP drafter holds an embedding of its own"
    assert all(w["max_concurrent_batches"] == 2 for w in res["workers"]), res["workers"]
    assert res["repeat_cached"] > 0, "the repeated prompt hit nothing in the prefix cache"
    assert res["repeat_output"] == res["outputs"][-1], "a prefix-cache hit changed the greedy tokens"
    assert_applied(res["log"], "engine", ENGINE_PATCHES)
    assert_applied(res["log"], "worker", WORKER_PATCHES, at_least=2)


def device_phase_patches(rank_lines: list[str]) -> dict[int, list[str]]:
    """Per PP rank, the patches its summary line lists as "patched once the device was set"."""
    found: dict[int, list[str]] = {}
    for line in rank_lines:
        rank = re.search(r"vllm-dualgpu rank (\d+)/\d+: ", line)
        if rank:
            m = re.search(rf"{DEVICE_PHASE_KEY}: (.*?)(?:; skipped |; [\w ./#-]+: |$)", line)
            names = [n.split(" (")[0].strip() for n in m.group(1).split(", ")] if m else []
            found[int(rank.group(1))] = [n for n in names if n and n != "none"]
    return found


@needs_pair()
@pytest.mark.timeout(300)
def test_eagle3_under_pp2_relays_the_aux_states(spec_models, gpu_out, record_property):
    model, drafter = spec_models
    res = run_llm(engine_kwargs(model, "eagle3", drafter), generate_and_probe, log=gpu_out / "eagle3.log", timeout=240,
                  env=pair_env())
    assert_generated(res)
    record_property("spec_metrics (acceptance is not a claim: random weights)", res["spec_metrics"])
    assert res["workers"][-1]["drafter"] == gm.EAGLE3_DRAFTER_CLASS.rsplit(".", 1)[1]
    for w in res["workers"]:
        layers = w.get("aux_hidden_state_layers")
        assert layers == gm.EAGLE3_AUX_LAYERS, f"rank {w['pp_rank']} captures {layers}"
        expected = 0 if w["pp_rank"] == 0 else sum(1 for layer in layers if layer <= w["start_layer"])
        assert w["supports_aux_hidden_states_over_pp"] is True and w["aux_slot_base"] == expected, w
    device = device_phase_patches(grep(res["log"], r"vllm-dualgpu rank \d+/\d+: "))
    assert sorted(device) == [0, 1], f"rank lines: {device}"
    for rank, names in device.items():
        assert set(DEVICE_PATCHES) <= set(names), f"rank {rank} patched once the device was set: {names}"
    assert_applied(res["log"], "worker", EAGLE3_WORKER_PATCHES, at_least=2)
    assert_applied(res["log"], "engine", ENGINE_PATCHES)


@needs_pair()
@pytest.mark.timeout(200)
def test_stock_vllm_refuses_eagle3_under_pp2(spec_models, gpu_out):
    model, drafter = spec_models
    res = run_llm(engine_kwargs(model, "eagle3", drafter, backend="mp"), None, log=gpu_out / "stock.log", timeout=150)
    assert "boot_s" not in res, "stock vLLM booted EAGLE3 under PP=2"
    refused = grep(res["log"], STOCK_REFUSAL) or re.findall(STOCK_REFUSAL, res.get("error", ""))
    assert refused, f"no refusal with vLLM's message:\n{tail(res['log'])}"
