"""DFlash2 with a scaled-down drafter of the reference's shape next to the hybrid, stock vLLM on one
rank against the plugin under PP=2 (issue #23: "DFlash with a drafter of the reference DFlash2
shape" and "the executor's KV pricing where it differs from the mirror").

Models (gpu_models.write_dflash_models, seeded random weights, written once per session): the
target is spec-hybrid (8 layers: 6 Gated DeltaNet + 2 full attention, hidden 1024, vocabulary
8192); the drafter is tests/fixtures/dflash2_drafter.json scaled to it ("DFlash2DraftModel",
vLLM's DFlash2Qwen3ForCausalLM, run by the V2 runner's DFlash2Speculator (CUDA's default runner
here; V1 refuses the drafter): 5 non-causal sliding-attention layers, window 1024, two grouped
convolutions a layer (2 taps, groups of 16), a candidate selector of rank 32 scoring 8 candidates a
draft position, target_layer_ids 1..5, mask token 8100; every linear layer but the selector's
projection compressed-tensors W4A16 pack-quantized, group 128, symmetric, the kernel projections
included; no embedding or lm_head of its own: vLLM gives it the target's). Runs
(gpu_runs.dflash_kwargs): bf16, eager, prefix caching, 7 draft tokens, Triton attention for the
target in both; stock with the GPU to itself (PP=1), then the plugin on the pair (pair_env: the
virtual pair on one GPU) with the split pinned to 4/4 and its plan written to a file. The same
four token-id prompts (the spec runs'), greedy, 48 tokens each, then the long one again (a
prefix-cache hit).

Claims:
- the plugin's tokens equal stock's (bf16: a divergence passes only as a near tie in both runs'
  top-5 logprobs, gpu_tokens.compare strict=False), and each run's repeated long prompt hit the
  prefix cache and gave its first tokens again (near ties allowed);
- the drafter drafted in both runs (vLLM's spec-decode counters, LLM.get_metrics());
- in both runs the drafter is DFlash2Qwen3ForCausalLM under the DFlash2Speculator, its 5 layers
  non-causal with the 1024 window, its selector's projection unquantized (a bf16 ``weight``); in
  the plugin run it is on the last rank only, uses the target's embedding and lm_head, and runs
  its linear layers (a kernel projection too) through compressed-tensors' W4A16 scheme with the
  same kernel as stock; both ranks capture target layers [2..6] (ids + 1), rank 1's relay slots
  are the ids up to its first layer (3: ids 2, 3 and 4 come from rank 0);
- the DFlash patches of the registry for the installed vLLM were applied (engine: the KV
  grouping patches; workers: the drafter's shared embedding and the aux-state flag; each rank
  once its device was set: the aux-state relay and Qwen3.5's aux layers);
- the pool the executor planned is the pool vLLM allocated: the plan file's num_blocks (equal to
  the executor's "predicted KV pool N blocks" line) equals cache_config.num_gpu_blocks after boot
  and each worker's kv_cache_config.num_blocks, with as many KV cache groups as the plan priced.
  vLLM's "GPU KV cache size: N tokens" line is not the pool: vLLM 0.33 logs max concurrency x
  max_model_len there (v1/core/kv_cache_utils.py:1120-1153); it is recorded only.

Not claimed: acceptance. Both models are random, so the drafter almost never agrees with the
target (acceptance near zero; the counters are recorded): the tokens are the target's greedy
tokens, and a token-for-token match says the target's forward under PP (with the aux states
relayed) and the verification give stock's tokens, not that the drafter's proposals are stock's.
Which W4A16 kernel runs is read from vLLM 0.33's source, not asserted: on SM 9.0 the first that
implements group-128 uint4b8 with bf16 activations is Machete (model_executor/kernels/linear/
__init__.py:540-548, mixed_precision/machete.py:24-54; CUTLASS W4A8 takes FP8 activations only),
compiled into vLLM's _C; the probe records the class each run used and asserts both used the same.
The drafter's attention backend (non-causal-capable, vLLM's choice) is recorded, not asserted.
The H200 runs the drafter in both runs (the plugin's last rank presents SM 9.0; rank 0, presenting
SM 8.9, holds no drafter). The engine configs and the plan are built on the CPU in
tests/integration/test_gpu_run_configs.py, the drafter's files in tests/unit/gpu_support/test_gpu_models.py.
"""

from __future__ import annotations

import bisect
import json
import os
import re

import pytest

import gpu_models as gm
import gpu_runs
import gpu_tokens as tok
from gpu_harness import (FIRST_GDN_BOOT_S, TORCH_TOPK_ENV, TORCH_TOPK_LINE, assert_applied, assert_ran,  # noqa: F401
                         gpu_out, grep, needs_pair, pair_env, patches_in_force, run_llm, tail)

PLAN_LINE = r"vllm-dualgpu plan: .*, predicted KV pool ([\d,]+) blocks"
KV_SIZE_LINE = r"GPU KV cache size: ([\d,]+) tokens"
POOL_LINES = r"vLLM's profile leaves|vllm-dualgpu rank \d+ profiled: |vLLM's functions give this split"
DEVICE_PHASE_KEY = "patched once the device was set"
# The registry's entries for DFlash next to the hybrid under PP, by family (an entry's name, or the
# name with a release suffix such as "-033"); resolved for the installed vLLM in dflash_patches.
PATCH_FAMILIES = {
    "engine": ("pp-inflight-batches", "kv-groups-know-ranks", "kv-groups-without-padding", "kv-drafter-pages-promoted"),
    "worker": ("pp-inflight-batches", "drafter-shares-target-embed", "qwen3-next-aux-hidden-flag",
               "dflash-quantized-context-kv-build", "dflash-quantized-context-kv-project"),
    "device": ("qwen3-next-aux-hidden-relay", "qwen3-5-aux-hidden-layers"),
}


def dflash_patches(kind: str) -> list[str]:
    """The registry entries of ``kind``'s families in force for the installed vLLM (an entry fixed
    upstream, such as the quantized context-K/V pair since 0.31, is not in force)."""
    return patches_in_force(PATCH_FAMILIES[kind])


def probe_worker(worker) -> dict:
    """In each worker (collective_rpc): the target's aux layers, the KV pool, the drafter."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    target = runner.model
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    decoder = language.model
    facts = {"pp_rank": get_pp_group().rank_in_group, "start_layer": getattr(decoder, "start_layer", None),
             "aux_hidden_state_layers": sorted(getattr(decoder, "aux_hidden_state_layers", ()) or ()),
             "supports_aux_hidden_states_over_pp": bool(getattr(decoder, "supports_aux_hidden_states_over_pp", False)),
             "aux_slot_base": getattr(decoder, "_aux_slot_base_cached", None)}
    kv = getattr(runner, "kv_cache_config", None)
    if kv is not None:
        facts["kv_num_blocks"] = kv.num_blocks
        facts["kv_groups"] = [[type(g.kv_cache_spec).__name__, len(g.layer_names), g.kv_cache_spec.block_size]
                              for g in kv.kv_cache_groups]
    holder = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)  # V2 / V1 runner
    drafter = getattr(holder, "model", None)
    if drafter is not None:
        inner = drafter.model
        facts["speculator"] = type(holder).__name__
        facts["drafter"] = type(drafter).__name__
        facts["drafter_embed_is_target_embed"] = inner.embed_tokens is getattr(decoder, "embed_tokens", None)
        facts["drafter_lm_head_is_target_lm_head"] = drafter.lm_head is getattr(language, "lm_head", None)
        layer0 = inner.layers[0]
        linears = {"qkv_proj": layer0.self_attn.qkv_proj, "down_proj": layer0.mlp.down_proj, "fc": inner.fc,
                   "attention_conv.kernel_projection": layer0.attention_conv.kernel_projection,
                   "candidate_selector.hidden_projection": inner.candidate_selector.hidden_projection}
        facts["drafter_linears"] = {
            name: {"scheme": type(getattr(m, "scheme", None)).__name__,
                   "kernel": type(getattr(getattr(m, "scheme", None), "kernel", None)).__name__,
                   "params": sorted(n for n, _ in m.named_parameters(recurse=False))}
            for name, m in linears.items()}
        facts["drafter_windows"] = [layer.self_attn.sliding_window for layer in inner.layers]
        facts["drafter_causal"] = list(drafter.get_draft_attn_causal())
        facts["drafter_attn_backend"] = layer0.self_attn.attn.get_attn_backend().get_name()
        if kv is not None:
            names = set(drafter.get_draft_kv_cache_layer_names())
            facts["drafter_kv_groups"] = [i for i, g in enumerate(kv.kv_cache_groups) if names & set(g.layer_names)]
    return facts


def generate_and_probe(llm) -> dict:
    import sys

    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import this file
    sp = SamplingParams(temperature=0, max_tokens=gpu_runs.DFLASH_MAX_TOKENS, ignore_eos=True, detokenize=False,
                        logprobs=tok.LOGPROBS)
    ps = gpu_runs.spec_prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": ps[-1]}], sp, use_tqdm=False)[0]
    cc = llm.llm_engine.vllm_config.cache_config
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [tok.token_logprobs(o.outputs[0]) for o in outs],
            "repeat_cached": again.num_cached_tokens or 0, "repeat_output": list(again.outputs[0].token_ids),
            "repeat_logprobs": tok.token_logprobs(again.outputs[0]),
            "num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
            "spec": tok.spec_counters(llm),
            "workers": sorted(llm.collective_rpc(probe_worker, timeout=60), key=lambda w: w["pp_rank"])}


def device_phase(log) -> dict[int, list[str]]:
    """Per PP rank, the patches its summary line lists as applied once the device was set."""
    found: dict[int, list[str]] = {}
    for line in grep(log, r"vllm-dualgpu rank \d+/\d+: "):
        rank = re.search(r"vllm-dualgpu rank (\d+)/\d+: ", line)
        m = re.search(rf"{DEVICE_PHASE_KEY}: (.*?)(?:; skipped |; [\w ./#-]+: |$)", line)
        found[int(rank.group(1))] = [n.split(" (")[0].strip() for n in m.group(1).split(", ")] if m else []
    return found


@pytest.fixture(scope="module")
def dflash_models(tmp_path_factory):
    return gm.write_dflash_models(tmp_path_factory.mktemp("dflash"))


def check_run(name: str, res: dict, record_property) -> None:
    """What each run must show on its own: every prompt generated, the drafter drafted, the
    repeated long prompt hit the prefix cache and gave its tokens again."""
    assert_ran(res)
    if os.environ.get(TORCH_TOPK_ENV) == "1":  # both arms alike: torch.topk, not FlashInfer's JIT-built one
        record_property(f"{name} vocab top-k", "torch (DUALGPU_GPU_TORCH_TOPK=1)")
        assert grep(res["log"], TORCH_TOPK_LINE), f"{name}: the torch top-k switch was on and no process applied it"
    n = gpu_runs.DFLASH_MAX_TOKENS
    assert [len(o) for o in res["outputs"]] == [n] * len(gpu_runs.spec_prompts()), f"{name}: {res['outputs']}"
    record_property(f"{name} boot_s", res["boot_s"])
    record_property(f"{name} spec counters (acceptance is not a claim: random weights)", res["spec"])
    assert res["spec"]["num_draft_tokens"] > 0, f"{name}: the DFlash drafter proposed no tokens: {res['spec']}"
    record_property(f"{name} repeat cached tokens", res["repeat_cached"])
    assert res["repeat_cached"] > 0, f"{name}: the repeated long prompt hit nothing in the prefix cache"
    c = tok.compare([res["outputs"][-1]], [res["repeat_output"]], [res["logprobs"][-1]], [res["repeat_logprobs"]],
                    strict=False)
    assert c["ok"], f"{name}: a prefix-cache hit changed the greedy tokens: {c['mismatches']}"
    drafters = [w for w in res["workers"] if "drafter" in w]
    assert [w["drafter"] for w in drafters] == [gm.DFLASH_DRAFTER_CLASS.rsplit(".", 1)[1]], res["workers"]
    d = drafters[0]
    assert d["speculator"] == "DFlash2Speculator", f"{name}: the drafter ran under {d['speculator']}"
    record_property(f"{name} drafter linears", d["drafter_linears"])
    record_property(f"{name} drafter attention backend", d["drafter_attn_backend"])
    assert d["drafter_embed_is_target_embed"] and d["drafter_lm_head_is_target_lm_head"], d
    linears = dict(d["drafter_linears"])
    selector = linears.pop("candidate_selector.hidden_projection")
    assert selector["scheme"] == "NoneType" and selector["params"] == ["weight"], f"{name}: selector projection {selector}"
    for layer, facts in linears.items():
        assert facts["scheme"] == "CompressedTensorsWNA16", f"{name}: the drafter's {layer} runs {facts}"
        assert "weight" not in facts["params"] and "weight_packed" in facts["params"], f"{name}: {layer} {facts}"
    assert d["drafter_windows"] == [gm.DFLASH_WINDOW] * 5 and d["drafter_causal"] == [False] * 5, d


@needs_pair()
@pytest.mark.timeout(FIRST_GDN_BOOT_S + 480)
def test_dflash_under_pp2_gives_stocks_tokens_and_the_planned_pool(dflash_models, gpu_out, record_property):
    target, drafter = dflash_models["target"], dflash_models["drafter"]
    stock = run_llm(gpu_runs.dflash_kwargs(target, drafter, 1), generate_and_probe, log=gpu_out / "stock.log",
                    timeout=FIRST_GDN_BOOT_S, env=tok.run_env("bfloat16", gpu="0"))
    check_run("stock", stock, record_property)
    plan_file = gpu_out / "plan.json"
    plan_file.unlink(missing_ok=True)
    plugin = run_llm(gpu_runs.dflash_kwargs(target, drafter, 2), generate_and_probe, log=gpu_out / "plugin.log",
                     timeout=330, env={**tok.run_env("bfloat16"), **pair_env(), **gpu_runs.DFLASH_ENV,
                                       "VLLM_DUALGPU_PLAN_FILE": str(plan_file)})
    check_run("plugin", plugin, record_property)

    # the plugin's tokens are stock's
    c = tok.compare(stock["outputs"], plugin["outputs"], stock["logprobs"], plugin["logprobs"], strict=False)
    record_property("stock vs plugin identical", f"{c['identical']}/{c['prompts']}")
    record_property("stock vs plugin near ties", c.get("near_ties", 0))
    assert c["ok"], f"stock vs plugin: {c['identical']}/{c['prompts']} identical; first: {c['mismatches'][:1]}"

    # the drafter on the last rank only; the aux states captured and relayed over the 4/4 split
    workers = plugin["workers"]
    assert [w["pp_rank"] for w in workers] == [0, 1], f"ranks probed: {workers}"
    first, last = workers
    assert "drafter" in last and "drafter" not in first, f"the drafter is not on the last rank only: {workers}"
    kernels = {layer: f["kernel"] for layer, f in last["drafter_linears"].items()}  # the selector's: NoneType
    stock_kernels = {layer: f["kernel"] for layer, f in stock["workers"][0]["drafter_linears"].items()}
    record_property("W4A16 kernel (stock / plugin's last rank)", f"{stock_kernels} / {kernels}")
    assert kernels == stock_kernels, f"the drafter's W4A16 kernels: stock {stock_kernels}, plugin {kernels}"
    aux = [i + 1 for i in gm.DFLASH_TARGET_LAYER_IDS]
    assert last["start_layer"] == gm.DFLASH_SPLIT[0], f"rank 1 starts at layer {last['start_layer']}"
    for w in workers:
        assert w["aux_hidden_state_layers"] == aux and w["supports_aux_hidden_states_over_pp"], w
    assert first["aux_slot_base"] == 0 and last["aux_slot_base"] == bisect.bisect_right(aux, last["start_layer"]) == 3, \
        f"relay slots: rank 0 {first['aux_slot_base']}, rank 1 {last['aux_slot_base']}"

    # the DFlash patches were applied in every process of the run
    assert_applied(plugin["log"], "engine", dflash_patches("engine"))
    assert_applied(plugin["log"], "worker", dflash_patches("worker"), at_least=2)
    device = device_phase(plugin["log"])
    assert sorted(device) == [0, 1], f"rank lines: {device}"
    for rank, names in device.items():
        assert set(dflash_patches("device")) <= set(names), f"rank {rank} patched once the device was set: {names}"

    # the pool the executor planned is the pool vLLM allocated
    plan = json.loads(plan_file.read_text())
    logged = [int(re.search(PLAN_LINE, line).group(1).replace(",", "")) for line in grep(plugin["log"], PLAN_LINE)]
    pool_lines = grep(plugin["log"], POOL_LINES)
    sized = [re.search(KV_SIZE_LINE, line).group(0) for line in grep(plugin["log"], KV_SIZE_LINE)]
    record_property("plan: split / blocks / block size", f"{plan['partition']} / {plan['num_blocks']} / {plan['block_size']}")
    record_property("vLLM: num_gpu_blocks / block size", f"{plugin['num_gpu_blocks']} / {plugin['block_size']}")
    record_property("vLLM's KV size line (capacity, not blocks)", sized)
    record_property("pool lines", pool_lines)
    assert plan["partition"] == gm.DFLASH_SPLIT, plan["partition"]
    assert logged == [plan["num_blocks"]], f"the executor logged {logged}, its plan file says {plan['num_blocks']}"
    why = "\n".join(pool_lines) or tail(plugin["log"])
    assert plugin["num_gpu_blocks"] == plan["num_blocks"], \
        f"the executor planned {plan['num_blocks']} blocks, vLLM allocated {plugin['num_gpu_blocks']}:\n{why}"
    assert [w["kv_num_blocks"] for w in workers] == [plan["num_blocks"]] * 2, [w["kv_num_blocks"] for w in workers]
    groups, planned = [len(w["kv_groups"]) for w in workers], plan["kv_cache"]["groups"]
    record_property("KV cache groups per rank (vLLM) / planned", f"{[w['kv_groups'] for w in workers]} / {planned}")
    assert groups == [len(planned)] * 2, f"vLLM formed {groups} groups, the plan priced {planned}"
    assert plugin["block_size"] == plan["block_size"], f"block size: vLLM {plugin['block_size']}, plan {plan['block_size']}"
