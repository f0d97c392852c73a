"""Issue #7 on GPUs: stock vLLM on one GPU vs the plugin with PP=2 over two, token for token.

Per model (``small-dense``; ``small-hybrid`` with MTP, or in float32 ``small-attn-mtp``), seeded
random weights: stock vLLM (PP=1, GPU 0), then the plugin (PP=2, ballast leaving 32 GiB free on
GPU 0 and 16 GiB on GPU 1, or on one GPU the virtual pair of those cards), each generating the three passes of gpu_tokens. Claims: every pass of
the plugin equals stock's (near ties only, in bf16); within each run the hit passes equal the
no-hits pass; the hit passes did hit; the MTP runs drafted. E2E_DTYPE=float32 makes every
comparison strict. The CPU part (the comparison itself) is tests/unit/gpu_support/test_gpu_tokens.py.
"""

from __future__ import annotations

import functools

import pytest

import gpu_tokens as tok
from gpu_harness import assert_ran, gpu_out, model_dir, needs_pair, pair, run_llm  # noqa: F401

FREE_GIB = [32.0, 16.0]
DTYPE = tok.e2e_dtype()


def check(record_property, name: str, ref: dict, got: dict, strict: bool) -> None:
    c = tok.compare(ref["outputs"], got["outputs"], ref["logprobs"], got["logprobs"], strict=strict)
    record_property(f"{name} identical", f"{c['identical']}/{c['prompts']}")
    record_property(f"{name} near ties", c.get("near_ties", 0))
    first = c["mismatches"][0] if c["mismatches"] else None
    assert c["ok"], f"{name}: {c['identical']}/{c['prompts']} identical{' (strict)' if strict else ''}; first: {first}"


@needs_pair()
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,mtp", [("dense", False), (tok.mtp_model(DTYPE), True)])
def test_pp2_through_the_plugin_gives_stocks_tokens(model, mtp, model_dir, gpu_out, record_property):
    folder = model_dir(tok.PRESETS[model], "random")
    prompts = tok.build_prompts(seed=0)
    job = functools.partial(tok.three_passes, prompts=prompts)
    strict = DTYPE == "float32"
    stock = run_llm(tok.engine_kwargs(model, folder, 1, DTYPE, mtp), job, log=gpu_out / "stock.log",
                    timeout=330, env=tok.run_env(DTYPE, gpu="0"))
    assert_ran(stock)
    with pair(FREE_GIB, gpu_out) as pair_vars:
        plugin = run_llm(tok.engine_kwargs(model, folder, 2, DTYPE, mtp), job, log=gpu_out / "plugin.log",
                         timeout=330, env={**tok.run_env(DTYPE), **pair_vars})
    assert_ran(plugin)
    record_property("boot_s stock / plugin", f"{stock['boot_s']} / {plugin['boot_s']}")
    families = [i for i, f in enumerate(prompts["family"]) if f is not None]
    for run, res in (("stock", stock), ("plugin", plugin)):
        passes = res["passes"]
        assert not any(passes["no-hits"]["num_cached_tokens"]), f"{run}: no-hits read the prefix cache"
        for p in ("prefix-hits", "full-hits"):
            hits = sum(passes[p]["num_cached_tokens"][i] for i in families)
            record_property(f"{run} {p} cached tokens", hits)
            assert hits > 0, f"{run}: no prefix-cache hit in {p}"
            check(record_property, f"{run} no-hits vs {p}", passes["no-hits"], passes[p], strict)
        for i, out in enumerate(passes["no-hits"]["outputs"]):
            assert len(out) == prompts["max_tokens"][i], f"{run}: prompt {i} got {len(out)} tokens"
        if mtp:
            record_property(f"{run} spec counters", res["spec"])
            assert res["spec"]["num_draft_tokens"] > 0, f"{run}: MTP proposed no draft tokens"
    for p in tok.PASSES:
        check(record_property, f"stock vs plugin {p}", stock["passes"][p], plugin["passes"][p], strict)
