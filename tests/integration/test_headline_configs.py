"""benchmarks/headline.py's arms (issue 18) as vLLM builds them on the CPU: every arm's real
VllmConfig, checked against what the issue asks (backends, splits, flags, weight formats); and the
parts of the speed-aware split that need no GPU (the planner's split for measured bandwidths, the
verdict). Nothing here starts an engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import headline as hl  # noqa: E402

from vllm_dualgpu.engine import preflight  # noqa: E402

TOTAL = 143771 / 1024  # an H200 as NVML reports it, GiB
CHOSEN = [24, 40]  # a split for arm 3 to start the split arms from


def executor(cfg) -> str:
    backend = cfg.parallel_config.distributed_executor_backend
    return getattr(backend, "__name__", str(backend))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("headline")
    return {q: hl.write_reference_model(root / q, q) for q in ("w8a16", "fp8", "nvfp4")}


def by_name(arms):
    return {a.name.split("/", 1)[1]: a for a in arms}


def test_utilizations_are_the_highest_that_pass_the_free_memory_check():
    # 16 GiB free of 140.4: 0.1139 -> 0.11 (0.12 x 140.4 = 16.8 GiB would fail vLLM's check)
    assert hl.utilizations([16.0, 32.0], TOTAL) == [0.11, 0.10, 0.09]
    assert hl.utilizations([32.0, 16.0], 80.0, tries=2) == [0.2, 0.19]
    for u in hl.utilizations([16.0, 32.0], TOTAL):
        assert u * TOTAL <= 16.0


def test_the_arms_are_the_issues(tmp_path):
    arms = hl.arm_specs("fp8", tmp_path, total_gib=TOTAL, chosen=CHOSEN)
    a = by_name(arms)
    assert list(a) == ["stock-default", "stock-u0.11", "stock-u0.10", "stock-u0.09", "expert", "plugin",
                       "split-22_42", "split-26_38", "split-20_44"]
    assert [x.kind for x in arms] == ["stock"] * 4 + ["expert", "plugin"] + ["split"] * 3
    common = hl.common_kwargs(tmp_path)
    assert common["max_model_len"] == 262144 and common["kv_cache_dtype"] == "fp8"
    assert common["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert (common["max_num_seqs"], common["max_num_batched_tokens"]) == (2, 1024)
    assert common["load_format"] == "dummy" and common["pipeline_parallel_size"] == 2
    # arm 1: stock, vLLM's even split, vLLM's default utilization first
    assert a["stock-default"].kwargs == {**common, "distributed_executor_backend": "mp"}
    assert "VLLM_PP_LAYER_PARTITION" not in a["stock-default"].env
    assert a["stock-u0.11"].kwargs["gpu_memory_utilization"] == 0.11
    # arm 3: the plugin with no flag but the backend
    assert a["plugin"].kwargs == {**common, "distributed_executor_backend": "dualgpu"}
    assert set(a["plugin"].env) == {"CUDA_DEVICE_ORDER"}
    # arm 4: the plugin's split +-2 and the expert's, nothing else changed
    for name, part in (("split-22_42", "22,42"), ("split-26_38", "26,38"), ("split-20_44", "20,44")):
        assert a[name].kwargs == a["plugin"].kwargs and a[name].env["VLLM_PP_LAYER_PARTITION"] == part
    # arm 2: the reference setup's launcher flags
    e = a["expert"]
    assert e.kwargs["distributed_executor_backend"] == "mp"
    assert (e.kwargs["block_size"], e.kwargs["num_gpu_blocks_override"]) == (1664, 180)
    assert e.kwargs["kv_cache_memory_bytes"] == 9 * 10**9
    assert e.kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert e.kwargs["enable_flashinfer_autotune"] is False and e.kwargs["gpu_memory_utilization"] == 0.11
    assert e.env["VLLM_PP_LAYER_PARTITION"] == "20,44" and e.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    # without arm 3's split there are no split arms; a split equal to the plugin's is not rerun
    assert [x.kind for x in hl.arm_specs("fp8", tmp_path, total_gib=TOTAL)].count("split") == 0
    same = by_name(hl.arm_specs("fp8", tmp_path, total_gib=TOTAL, chosen=[20, 44]))
    assert [n for n in same if n.startswith("split")] == ["split-18_46", "split-22_42"]
    assert by_name(hl.arm_specs("w8a16", tmp_path, total_gib=TOTAL))["expert"].env["VLLM_PP_LAYER_PARTITION"] == "18,46"


def test_the_model_is_the_bundled_reference_in_each_format(models):
    import json

    from vllm_dualgpu.planner import reference_config

    ref = reference_config("qwen3.8-27b")
    for q, d in models.items():
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["text_config"] == ref["text_config"] and cfg["vision_config"] == ref["vision_config"], q
        assert (d / "preprocessor_config.json").exists() and (d / "tokenizer.json").exists()
    quant = {q: json.loads((d / "config.json").read_text())["quantization_config"] for q, d in models.items()}
    assert quant["fp8"] == ref["quantization_config"]
    assert quant["w8a16"]["ignore"] == ref["quantization_config"]["modules_to_not_convert"]
    assert quant["w8a16"]["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    assert quant["nvfp4"]["quant_algo"] == "NVFP4"


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["w8a16", "fp8", "nvfp4"])
def test_every_arm_builds_in_vllm(engine_config, models, monkeypatch, quant):
    """Each arm's VllmConfig as vLLM builds it: backend, split, weight format, MTP, vision, fp8 KV,
    context, batch flags; the expert's flags land where vLLM reads them; the plugin's arms pass
    the plugin's front-end checks with their split."""
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    expected_q = {"w8a16": "compressed-tensors", "fp8": "fp8", "nvfp4": "modelopt_fp4"}[quant]
    for arm in hl.arm_specs(quant, models[quant], total_gib=TOTAL, chosen=CHOSEN):
        with monkeypatch.context() as mp:
            for k, v in arm.env.items():
                mp.setenv(k, v)
            cfg = engine_config(**arm.kwargs)
            pc, cc, sc = cfg.parallel_config, cfg.cache_config, cfg.scheduler_config
            assert executor(cfg) == ("DualGpuExecutor" if arm.kind in ("plugin", "split") else "mp"), arm.name
            assert pc.pipeline_parallel_size == 2, arm.name
            assert cfg.model_config.quantization == expected_q, arm.name
            assert cfg.model_config.max_model_len == 262144 and cc.cache_dtype == "fp8", arm.name
            assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (2, 1024), arm.name
            spec = cfg.speculative_config
            assert spec.method == "mtp" and spec.num_speculative_tokens == 3, arm.name
            # the vision tower is on: the target takes images (the MTP drafter's copy does not)
            assert cfg.model_config.multimodal_config is not None, arm.name
            assert not cfg.model_config.multimodal_config.language_model_only, arm.name
            assert cfg.model_config.is_multimodal_model, arm.name
            assert cc.enable_prefix_caching, arm.name
            if arm.kind == "expert":
                assert (cc.block_size, cc.num_gpu_blocks_override) == (1664, 180)
                assert cc.kv_cache_memory_bytes == 9 * 10**9 and cc.gpu_memory_utilization == 0.11
                # PIECEWISE reaches vLLM's config (the CPU platform then turns CUDA graphs off)
                assert EngineArgs(**arm.kwargs).compilation_config.cudagraph_mode.name == "PIECEWISE"
                assert cfg.kernel_config.enable_flashinfer_autotune is False
            else:
                assert cc.num_gpu_blocks_override is None and cc.kv_cache_memory_bytes is None, arm.name
                # CUDA graphs as vLLM defaults them (the CPU platform turns them off here, so the
                # arguments are what is checked): no compilation flag, no eager mode
                assert "compilation_config" not in arm.kwargs and "enforce_eager" not in arm.kwargs, arm.name
            if arm.kind in ("plugin", "split"):
                preflight.check(cfg, 2)  # a refusal raises PreflightError; warnings are allowed
            if arm.kind in ("plugin", "split") or arm.name.endswith("stock-default"):
                assert cc.gpu_memory_utilization == CacheConfig().gpu_memory_utilization, arm.name  # vLLM's default


@pytest.mark.slow
def test_w8a16_quantizes_what_the_reference_checkpoint_does(engine_config, models, qwen3_5):
    """vLLM's compressed-tensors config of the W8A16 model, as its loader prepares it for
    Qwen3_5ForConditionalGeneration (names through its hf_to_vllm_mapper, its fused layers): the
    language model's linear layers int8 weight-only, the vision tower and the GDN in_proj_a/b in
    16 bits."""
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear

    cfg = engine_config(**hl.arm_specs("w8a16", models["w8a16"], total_gib=TOTAL)[-1].kwargs)
    qc = VllmConfig._get_quantization_config(cfg.model_config, cfg.load_config)
    assert type(qc).__name__ == "CompressedTensorsConfig"
    cls = qwen3_5.Qwen3_5ForConditionalGeneration
    qc.apply_vllm_mapper(cls.hf_to_vllm_mapper.get_rename_mapper())
    qc.packed_modules_mapping = dict(cls.packed_modules_mapping)

    def method(cls, prefix):
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        m = qc.get_quant_method(layer, prefix)
        return type(m).__name__, type(getattr(layer, "scheme", None)).__name__

    assert method(QKVParallelLinear, "language_model.model.layers.3.self_attn.qkv_proj")[0] == "CompressedTensorsLinearMethod"
    assert method(ColumnParallelLinear, "visual.blocks.0.mlp.linear_fc1")[0] == "UnquantizedLinearMethod"
    assert method(ColumnParallelLinear, "language_model.model.layers.0.linear_attn.in_proj_ba")[0] == "UnquantizedLinearMethod"


def test_the_planner_moves_layers_off_a_slower_card(models):
    """The split the speed mode compares with the fastest measured one: the pure planner, speed
    objective, for this pair with the measured bandwidths. A card with half the bandwidth gets
    fewer layers than with equal cards, and with the bandwidths the other way round the other
    card does: the bandwidth decides. Every plan holds all 64 layers."""
    d = models["fp8"]
    equal = hl.planned_split(d, hl.FREE, TOTAL, [4800.0, 4800.0], "speed")
    slow1 = hl.planned_split(d, hl.FREE, TOTAL, [4800.0, 2400.0], "speed")
    slow0 = hl.planned_split(d, hl.FREE, TOTAL, [2400.0, 4800.0], "speed")
    for p in (equal, slow1, slow0):
        assert sum(p["partition"]) == 64 and sorted(p["order"]) == [0, 1]

    def on_gpu(p, gpu):
        return p["partition"][p["order"].index(gpu)]

    assert on_gpu(slow1, 1) < on_gpu(equal, 1)
    assert on_gpu(slow0, 0) < on_gpu(equal, 0)


def _sweep(readings):
    return [{"name": f"s{p[0]}", "partition": list(p), "kv_tokens": kv,
             "runs": [{"decode_ms_per_step": x} for x in ms]} for p, kv, ms in readings]


def test_speed_verdict_finds_the_fastest_split_that_holds_the_context():
    res = {"bw_before": {"copy_gbps": [4000.0, 2000.0]}, "bw_after": {"copy_gbps": [4010.0, 1980.0]},
           "plugin": {"partition": [24, 40]}, "planned_measured": {"partition": [26, 38]},
           "sweep": _sweep([((22, 42), 300_000, (30.0, 30.2)), ((24, 40), 300_000, (31.0, 31.1)),
                            ((26, 38), 280_000, (30.6, 30.5)), ((28, 36), 200_000, (20.0, 20.0))])}
    v = hl.speed_verdict(res)
    # 28/36 is faster but holds 200,000 tokens, short of 262,144: not a candidate
    assert v["stable"] and v["why"] == []
    assert v["fastest"] == [22, 42] and v["fastest_ms"] == 30.0
    assert v["chosen"] == [24, 40] and v["chosen_vs_fastest_pct"] == pytest.approx(100 * (31.0 / 30.0 - 1), abs=0.01)
    assert v["planned_measured_vs_fastest_pct"] == pytest.approx(100 * (30.5 / 30.0 - 1), abs=0.01)


def test_speed_verdict_says_when_the_emulation_is_unstable():
    res = {"bw_before": {"copy_gbps": [4000.0, 2000.0]}, "bw_after": {"copy_gbps": [4000.0, 2300.0]},
           "plugin": {"partition": [24, 40]}, "sweep": _sweep([((24, 40), 300_000, (31.0, 33.0))])}
    v = hl.speed_verdict(res)
    assert not v["stable"] and len(v["why"]) == 2
    assert "moved more than 5%" in v["why"][0] and "differ by more than 1.5%" in v["why"][1]
    assert not hl.speed_verdict({})["stable"]


def test_largest_context_reads_vllms_and_the_plugins_refusals():
    assert hl.largest_context(["ValueError: ... the estimated maximum model length is 117504. Try"]) == 117504
    assert hl.largest_context(["does not fit ... rerun with --max-model-len 201,728 or less"]) == 201728
    assert hl.largest_context(["ValueError: out of memory"]) is None


def test_predicted_memory_is_placed_by_gpu_index_not_rank():
    """The plugin reorders (the 32 GiB card, GPU 1, may be rank 0): each rank's prediction goes to
    its GPU's column, next to that GPU's measured peak."""
    rank = lambda gpu, w, f, kv: {"gpu": {"index": gpu}, "weights_bytes": w, "fixed_bytes": f, "kv_cache_bytes": kv}
    gib = 1024**3
    plan = {"ranks": [rank(1, 20 * gib, 2 * gib, 8 * gib), rank(0, 10 * gib, gib, 3 * gib)]}
    assert hl.predicted_used_gib(plan) == [14.0, 30.0]
    assert hl.predicted_used_gib({}) == [None, None]


def test_the_table_has_a_row_per_arm():
    r = {"name": "fp8/plugin", "booted": True, "boot_s": 100.0, "kv_tokens": 300_000, "largest_context": 262144,
         "partition": [20, 44], "peak_used_gib": [14.5, 30.25], "predicted_used_gib": [14.0, 30.0],
         "mid": {"ttft_s": 9.5, "decode_ms_per_step": 30.0}, "short": {"decode_ms_per_step": 29.0}}
    refused = {"name": "fp8/stock-default", "booted": False, "kv_tokens": None, "largest_context": None,
               "peak_used_gib": [0.0, 0.0]}
    lines = hl.table([r, refused]).splitlines()
    assert lines[2] == ("| fp8/plugin | 20/44 | yes | 100.0 | 300,000 | 262,144 | 9.5 / - | 29.0 / 30.0 / - | - | "
                        "14.50 / 30.25 | 14.00 / 30.00 |")
    assert lines[3].startswith("| fp8/stock-default | even | no | - | - |")
