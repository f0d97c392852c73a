"""benchmarks/headline.py's arms (issues 18 and 28) as vLLM builds them on the CPU: every arm's
real VllmConfig, checked against what the issue asks (the four launchers, backends, splits, the
expert's flags, drafters, weight formats, the virtual pair); the headline.json schema; and the
parts of the speed-aware split that need no GPU (the planner's split for measured bandwidths, the
verdict). Nothing here starts an engine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import v2_runner_or_skip

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
    return hl.write_models(tmp_path_factory.mktemp("headline"))


def by_name(arms):
    return {a.name.split("/", 1)[1]: a for a in arms}


def test_utilizations_are_the_highest_that_pass_the_free_memory_check():
    # 16 GiB free of 140.4: 0.1139 -> 0.11 (0.12 x 140.4 = 16.8 GiB would fail vLLM's check)
    assert hl.utilizations([16.0, 32.0], TOTAL) == [0.11, 0.10, 0.09]
    assert hl.utilizations([32.0, 16.0], 80.0, tries=2) == [0.2, 0.19]
    for u in hl.utilizations([16.0, 32.0], TOTAL):
        assert u * TOTAL <= 16.0


def test_the_arms_are_the_issues_on_the_virtual_pair(tmp_path):
    """Issue 28: per launcher the expert, the plugin, its split -2/+2 and at the expert's split,
    on the default virtual pair (one GPU, no stock arm: stock vLLM cannot put two ranks on it)."""
    spec = hl.VIRTUAL
    assert spec == "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:display=yes"  # the reference's desktop card
    assert hl.virtual_cards(spec) == [16.0, 32.0]  # the small card first
    arms = hl.arm_specs("fp8-mtp", tmp_path, total_gib=TOTAL, chosen=CHOSEN, free_gib=[16.0, 32.0], virtual=spec)
    a = by_name(arms)
    assert list(a) == ["expert", "plugin", "at-expert-graphs", "split-2", "split+2", "split-at-expert"]
    assert "graphs" not in hl.DEFAULT_ARMS  # asked for by name (--arms graphs)
    common = hl.common_kwargs(tmp_path, "fp8-mtp")
    assert common["max_model_len"] == 262144 and common["kv_cache_dtype"] == "fp8"
    assert common["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert (common["max_num_seqs"], common["max_num_batched_tokens"]) == (2, 1024)
    assert common["load_format"] == "dummy" and common["pipeline_parallel_size"] == 2
    # the plugin: no flag but the backend; the virtual pair and spawned workers in its environment
    assert a["plugin"].kwargs == {**common, "distributed_executor_backend": "dualgpu"}
    assert a["plugin"].env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "VLLM_DUALGPU_VIRTUAL_GPUS": spec,
                               "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    for name, part in (("split-2", "22,42"), ("split+2", "26,38"), ("split-at-expert", "20,44")):
        assert a[name].kwargs == a["plugin"].kwargs and a[name].env["VLLM_PP_LAYER_PARTITION"] == part
        assert a[name].env["VLLM_DUALGPU_VIRTUAL_GPUS"] == spec
    # the plugin at the expert's split with the expert's CUDA graphs, nothing else of the expert's
    g = a["at-expert-graphs"]
    assert g.kwargs == {**a["plugin"].kwargs, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    assert g.kwargs["compilation_config"] == a["expert"].kwargs["compilation_config"]
    assert g.env == {**a["plugin"].env, "VLLM_PP_LAYER_PARTITION": "20,44"}
    # the expert: its launcher's flags through the dualgpu executor (the package's patches are the
    # reference's), on the virtual pair like the plugin; the attention backend left to the plugin
    e = a["expert"]
    assert e.kwargs["distributed_executor_backend"] == "dualgpu"
    assert not {"worker_cls", "gpu_memory_utilization", "attention_backend"} & set(e.kwargs)
    assert e.kwargs["num_gpu_blocks_override"] == 180 and "block_size" not in e.kwargs  # vLLM's 1,600
    assert e.kwargs["prefix_cache_retention_interval"] == 1600
    assert e.kwargs["kv_cache_memory_bytes"] == 9 * 10**9
    assert e.kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert e.kwargs["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3,
                                              "disable_eagle_block_drop": True}
    assert "enable_flashinfer_autotune" not in e.kwargs  # the MTP launcher does not pass it
    assert e.env == {**a["plugin"].env, **hl.EXPERT_ENV, "VLLM_PP_LAYER_PARTITION": "20,44"}
    # without arm 2's split there are no split arms; a split equal to the plugin's is not rerun
    assert [x.kind for x in hl.arm_specs("fp8-mtp", tmp_path, total_gib=TOTAL, virtual=spec)].count("split") == 0
    same = by_name(hl.arm_specs("fp8-mtp", tmp_path, total_gib=TOTAL, chosen=[20, 44], virtual=spec))
    assert [n for n in same if n.startswith("split")] == ["split-2", "split+2"]


def test_every_arm_of_a_launcher_has_its_own_files(tmp_path):
    """2026-12-04: split+2's log and result were written over split-2's (arm_file made both
    "fp8-mtp_split-2"): the 17/47 arm's log and record were lost, and headline.json kept split+2 only."""
    arms = hl.arm_specs("fp8-mtp", tmp_path, total_gib=TOTAL, chosen=CHOSEN, free_gib=[16.0, 32.0],
                        virtual=hl.VIRTUAL)
    files = [x.file for x in arms]
    assert len(set(files)) == len(files) == 6, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files


def test_the_dflash2_launchers_take_the_experts_flags(tmp_path):
    drafter = tmp_path / "drafter"
    splits = {"nvfp4-dflash2": "13,51", "w8a16-dflash2": "19,45", "fp8-dflash2": "21,43"}
    for launcher, split in splits.items():
        a = by_name(hl.arm_specs(launcher, tmp_path, total_gib=TOTAL, drafter=drafter, virtual=hl.VIRTUAL))
        assert a["plugin"].kwargs["speculative_config"] == {"method": "dflash", "model": str(drafter),
                                                            "num_speculative_tokens": 7}
        e = a["expert"]
        assert e.env["VLLM_PP_LAYER_PARTITION"] == split
        # the launchers' own environment (launchers/*-262k.sh: a 128 MiB FlashInfer workspace,
        # expandable segments); the plugin's arms run vLLM's defaults
        assert e.env["VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"] == "134217728"
        assert e.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert not {"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "PYTORCH_CUDA_ALLOC_CONF"} & set(a["plugin"].env)
        assert (e.kwargs["block_size"], e.kwargs["num_gpu_blocks_override"]) == (1664, hl.EXPERT_BLOCKS[launcher])
        assert e.kwargs["prefix_cache_retention_interval"] == 1664
        assert e.kwargs["enable_flashinfer_autotune"] is False
        assert e.kwargs["speculative_config"] == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7,
                                                  "disable_eagle_block_drop": True, "attention_backend": "TRITON_ATTN"}


def test_context_moves_the_plugin_and_split_arms_only(tmp_path):
    """--context: a launcher the plan says does not hold 262,144 runs its plugin and split arms at
    the length asked, named so they sit beside a 262,144 refusal; the expert keeps 262,144, and
    the long prompt leaves the same room below the shorter limit."""
    drafter = tmp_path / "drafter"
    a = by_name(hl.arm_specs("w8a16-dflash2", tmp_path, total_gib=TOTAL, drafter=drafter, chosen=[20, 44],
                             virtual=hl.VIRTUAL, context=229_376))
    assert list(a) == ["expert", "plugin@229376", "at-expert-graphs@229376", "split-2@229376", "split+2@229376",
                       "split-at-expert@229376"]
    assert a["expert"].kwargs["max_model_len"] == 262_144
    for name in ("plugin@229376", "split-2@229376", "split-at-expert@229376"):
        assert a[name].kwargs["max_model_len"] == 229_376
    assert a["split-at-expert@229376"].env["VLLM_PP_LAYER_PARTITION"] == "19,45"
    assert a["plugin@229376"].file == "w8a16-dflash2_plugin-at-229376"  # no "@" in file names
    assert hl.long_prompt(262_144) == 250_000 and hl.long_prompt(229_376) == 217_232


def test_two_gpus_keep_ballast_order_and_the_stock_arms(tmp_path):
    a = by_name(hl.arm_specs("fp8-mtp", tmp_path, total_gib=TOTAL, chosen=CHOSEN))
    assert list(a)[:5] == ["stock-default", "stock-u0.11", "stock-u0.10", "stock-u0.09", "expert"]
    assert a["stock-default"].kwargs["distributed_executor_backend"] == "mp"
    assert a["expert"].env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "VLLM_PP_LAYER_PARTITION": "20,44",
                               "CUDA_VISIBLE_DEVICES": "0,1", **hl.EXPERT_ENV}
    assert a["plugin"].env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_the_model_is_the_bundled_reference_in_each_format(models):
    import json

    from vllm_dualgpu.planner import reference_config

    ref = reference_config("qwen3.8-27b")
    targets = {q: d for q, d in models.items() if q != "drafter"}
    for q, d in targets.items():
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["text_config"] == ref["text_config"] and cfg["vision_config"] == ref["vision_config"], q
        assert (d / "preprocessor_config.json").exists() and (d / "tokenizer.json").exists()
    quant = {q: json.loads((d / "config.json").read_text())["quantization_config"] for q, d in targets.items()}
    assert quant["fp8"] == ref["quantization_config"]
    assert quant["w8a16"]["ignore"] == ref["quantization_config"]["modules_to_not_convert"]
    assert quant["w8a16"]["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    assert quant["nvfp4"]["quant_algo"] == "NVFP4"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", hl.LAUNCHERS)
def test_every_arm_builds_in_vllm(engine_config, models, monkeypatch, launcher):
    """Each arm's VllmConfig as vLLM builds it: backend, split, weight format, drafter, vision,
    fp8 KV, context, batch flags; the expert's flags land where vLLM reads them; the plugin's arms
    pass the plugin's front-end checks with their split."""
    if "dflash" in launcher:
        v2_runner_or_skip(monkeypatch)
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    quant = hl.QUANT[launcher]
    expected_q = {"w8a16": "compressed-tensors", "fp8": "fp8", "nvfp4": "modelopt_fp4"}[quant]
    dflash = launcher.endswith("dflash2")
    for arm in hl.arm_specs(launcher, models[quant], total_gib=TOTAL, drafter=models["drafter"], chosen=CHOSEN,
                            virtual=hl.VIRTUAL):
        with monkeypatch.context() as mp:
            for k, v in arm.env.items():
                mp.setenv(k, v)
            cfg = engine_config(**arm.kwargs)
            pc, cc, sc = cfg.parallel_config, cfg.cache_config, cfg.scheduler_config
            assert executor(cfg) == "DualGpuExecutor", arm.name
            assert pc.pipeline_parallel_size == 2, arm.name
            assert cfg.model_config.quantization == expected_q, arm.name
            assert cfg.model_config.max_model_len == 262144 and cc.cache_dtype == "fp8", arm.name
            assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (2, 1024), arm.name
            spec = cfg.speculative_config
            assert (spec.method, spec.num_speculative_tokens) == (("dflash", 7) if dflash else ("mtp", 3)), arm.name
            # the vision tower is on: the target takes images
            assert cfg.model_config.multimodal_config is not None, arm.name
            assert not cfg.model_config.multimodal_config.language_model_only, arm.name
            assert cfg.model_config.is_multimodal_model, arm.name
            assert cc.enable_prefix_caching, arm.name
            if arm.kind == "expert":
                assert cc.num_gpu_blocks_override == hl.EXPERT_BLOCKS[launcher]
                assert cc.block_size == 1664 or not dflash
                assert cc.kv_cache_memory_bytes == 9 * 10**9
                assert cc.gpu_memory_utilization == CacheConfig().gpu_memory_utilization  # the plugin sets it
                assert spec.disable_eagle_block_drop is True
                # PIECEWISE reaches vLLM's config (the CPU platform then turns CUDA graphs off)
                assert EngineArgs(**arm.kwargs).compilation_config.cudagraph_mode.name == "PIECEWISE"
                if dflash:
                    assert cfg.kernel_config.enable_flashinfer_autotune is False
                preflight.check(cfg, 2)
            else:
                assert cc.num_gpu_blocks_override is None and cc.kv_cache_memory_bytes is None, arm.name
                # CUDA graphs as vLLM defaults them (the CPU platform turns them off here, so the
                # arguments are what is checked): no compilation flag, no eager mode; the graphs arm
                # the expert's mode, which reaches vLLM's config
                assert "enforce_eager" not in arm.kwargs, arm.name
                if arm.kind == "graphs":
                    assert EngineArgs(**arm.kwargs).compilation_config.cudagraph_mode.name == "PIECEWISE"
                else:
                    assert "compilation_config" not in arm.kwargs, arm.name
                preflight.check(cfg, 2)  # a refusal raises PreflightError; warnings are allowed
                assert cc.gpu_memory_utilization == CacheConfig().gpu_memory_utilization, arm.name  # vLLM's default


@pytest.mark.slow
def test_w8a16_quantizes_what_the_reference_checkpoint_does(engine_config, models, qwen3_5, v2_runner):
    """vLLM's compressed-tensors config of the W8A16 model, as its loader prepares it for
    Qwen3_5ForConditionalGeneration (names through its hf_to_vllm_mapper, its fused layers): the
    language model's linear layers int8 weight-only in groups of 128 (the reference checkpoint's
    family: "group size 128, RTN", the reference's "INT8 group weights"), its input embedding
    INT8-packed (the reference's patch 08 passes quant_config to the embedding "so the INT8
    embed_tokens.weight_packed loads"), the vision tower and the GDN in_proj_a/b in 16 bits."""
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    cfg = engine_config(**hl.arm_specs("w8a16-dflash2", models["w8a16"], total_gib=TOTAL, drafter=models["drafter"],
                                       virtual=hl.VIRTUAL)[-1].kwargs)
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
    assert method(VocabParallelEmbedding, "language_model.model.embed_tokens")[0] == "CompressedTensorsEmbeddingWNA16Int"
    assert method(ParallelLMHead, "language_model.lm_head")[0] != "CompressedTensorsLinearMethod"  # bf16 head
    scheme = qc.get_scheme_dict(QKVParallelLinear.__new__(QKVParallelLinear), "language_model.model.layers.3.self_attn.qkv_proj")
    assert (scheme["weights"].strategy, scheme["weights"].group_size) == ("group", 128)


def test_the_planner_moves_layers_off_a_slower_card(models):
    """The split the speed mode compares with the fastest measured one: the pure planner, speed
    objective, for this pair with the measured bandwidths. A card with half the bandwidth gets
    fewer layers than with equal cards, and with the bandwidths the other way round the other
    card does: the bandwidth decides. Every plan holds all 64 layers.

    With 4 GiB more free a card than the virtual pair (hl.FREE): there, since the plan charges the
    Qwen3.5 family's input embedding on every rank, 262,144 tokens no longer fit (the largest is
    244,800, at 20/44), and with 1 GiB more a card every bandwidth still gets 20/44: memory, not
    the bandwidth, would decide."""
    d = models["fp8"]
    room = [f + 4.0 for f in hl.FREE]
    equal = hl.planned_split(d, room, TOTAL, [4800.0, 4800.0], "speed")
    slow1 = hl.planned_split(d, room, TOTAL, [4800.0, 2400.0], "speed")
    slow0 = hl.planned_split(d, room, TOTAL, [2400.0, 4800.0], "speed")
    for p in (equal, slow1, slow0):
        assert sum(p["partition"]) == 64 and sorted(p["order"]) == [0, 1]

    def on_gpu(p, gpu):
        return p["partition"][p["order"].index(gpu)]

    assert on_gpu(slow1, 1) < on_gpu(equal, 1)
    assert on_gpu(slow0, 0) < on_gpu(equal, 0)
    assert equal["max_model_len"] == hl.MAX_MODEL_LEN


def test_the_speed_modes_split_stands_where_262144_tokens_do_not_fit(models):
    """With 1 GiB less free on each card than the virtual pair's, FP8 + MTP holds fewer than
    262,144 tokens: the speed mode then compares against the plan at the largest length that fits
    instead of stopping. (On the virtual pair's own room it holds them since the calibration.)"""
    assert hl.planned_split(models["fp8"], hl.FREE, TOTAL, [4800.0, 4800.0], "speed")["max_model_len"] \
        == hl.MAX_MODEL_LEN
    p = hl.planned_split(models["fp8"], [f - 1.0 for f in hl.FREE], TOTAL, [4800.0, 4800.0], "speed")
    assert sum(p["partition"]) == 64
    assert 0 < p["max_model_len"] < hl.MAX_MODEL_LEN


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


def test_ranks_are_read_from_vllms_worker_prefixes():
    lines = ["(Worker_PP0 pid=101) INFO 12-01 [gpu_worker.py:1] ...", "(Worker_PP1_TP0 pid=202) INFO x",
             "(EngineCore pid=303) INFO y", "(Worker_PP1 pid=204) WARNING z", "(VllmWorker-1 pid=205) INFO b"]
    assert hl.rank_pids(lines) == {101: 0, 202: 1, 204: 1, 205: 1}


def test_the_predicted_peak_is_each_ranks_whole_charge():
    mib = 2**20
    rank = lambda w, f, r, kv: {"weights_bytes": w * mib, "fixed_bytes": f * mib, "reserve_bytes": r * mib,  # noqa: E731
                                "kv_cache_bytes": kv * mib}
    assert hl.predicted_peak_mib({"ranks": [rank(6000, 4000, 1500, 2400), rank(17000, 4600, 1200, 7300)]}) == \
        [13900, 30100]
    assert hl.predicted_peak_mib({}) is None


ARM = {"name": "fp8-mtp/plugin", "kind": "plugin", "launcher": "fp8-mtp", "booted": True, "kv_tokens": 336_000,
       "largest_context": 262144, "partition": [16, 48], "peak_mib": [14800, 30900], "card_mib": [16384, 32768],
       "predicted_peak_mib": [14500, 31000], "mid": {"ttft_s": 9.5, "decode_ms_per_step": 30.0},
       "short": {"decode_ms_per_step": 29.0}, "greedy_token_ids": [1, 2]}


def test_headline_json_is_the_issues_schema():
    row = hl.headline_row(ARM)
    assert {"launcher", "arm", "booted", "split", "max_model_len", "pool_tokens", "peak_mib", "card_mib",
            "ms_per_step", "ttft_s", "predicted_peak_mib"} <= set(row)
    assert (row["launcher"], row["arm"], row["booted"], row["split"]) == ("fp8-mtp", "plugin", True, [16, 48])
    assert (row["max_model_len"], row["pool_tokens"]) == (262144, 336_000)
    assert row["ms_per_step"] == {"short": 29.0, "32k": 30.0, "250k": None}
    assert row["ttft_s"] == {"32k": 9.5, "250k": None}
    assert (row["peak_mib"], row["card_mib"], row["predicted_peak_mib"]) == ([14800, 30900], [16384, 32768],
                                                                          [14500, 31000])
    refused = hl.headline_row({"name": "fp8-dflash2/expert", "kind": "expert", "launcher": "fp8-dflash2",
                               "booted": False, "refusals": ["ValueError: ... maximum model length is 117504."]})
    assert refused["booted"] is False and refused["arm"] == "expert" and "117504" in refused["refusal"]
    assert refused["cut_during_boot_s"] is None
    cut = hl.headline_row({"name": "fp8-mtp/plugin", "kind": "plugin", "launcher": "fp8-mtp", "booted": False,
                           "error": "no result", "timed_out": True, "wall_s": 458.4, "refusals": []})
    assert (cut["booted"], cut["refusal"], cut["cut_during_boot_s"]) == (False, None, 458.4)


def test_the_table_has_a_row_per_arm():
    refused = {"name": "fp8-mtp/expert", "kind": "expert", "launcher": "fp8-mtp", "booted": False, "kv_tokens": None,
               "largest_context": None, "partition": [20, 44]}
    lines = hl.table([ARM, refused]).splitlines()
    assert lines[2] == ("| fp8-mtp | plugin | 16/48 | yes | 336,000 | 262,144 | 9.5 / - | 29.0 / 30.0 / - | - | "
                        "14,800 / 30,900 | 16,384 / 32,768 | 14,500 / 31,000 |")
    assert lines[3].startswith("| fp8-mtp | expert | 20/44 | no | - | - |")
    cut = {**refused, "name": "fp8-mtp/plugin", "kind": "plugin", "timed_out": True, "wall_s": 458.4}
    assert hl.table([cut]).splitlines()[2].startswith("| fp8-mtp | plugin | 20/44 | cut at 458 s, booting | - |")


class NoPeaks:
    """headline.ProcessPeaks without NVML: no GPU sampled."""

    peak, gpu_peak, gpu_base = {}, [0], [0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_an_arm_cut_by_its_limit_keeps_what_it_measured(tmp_path, monkeypatch):
    """The engine booted and measured the short context, then the arm's limit cut it (no result
    file): the arm still counts as booted, with its pool and what ran, and says it was cut."""

    def cut(kwargs, job, *, log, timeout, env):
        progress = getattr(job, "keywords", {}).get("progress")
        hl.save_progress({"num_gpu_blocks": 210, "block_size": 1600, "short": {"decode_ms_per_step": 31.0}}, progress)
        return {"error": "no result", "timed_out": True, "wall_s": timeout, "log": log}

    monkeypatch.setattr(hl, "ProcessPeaks", NoPeaks)
    monkeypatch.setattr(hl, "run_llm", cut)
    arm = hl.Arm("fp8-mtp/plugin", "plugin", "fp8-mtp", {}, {})
    job = hl.functools.partial(hl.measure, deadline=0.0)
    r = hl.run_arm(arm, tmp_path, job, 300)
    assert (r["booted"], r["kv_tokens"], r["cut_after_boot"], r["timed_out"]) == (True, 336_000, True, True)
    assert hl.headline_row(r)["ms_per_step"]["short"] == 31.0
    uncut = hl.run_arm(arm, tmp_path, lambda llm: {}, 300)  # a job without progress: nothing to keep
    assert uncut["booted"] is False


def test_an_arm_that_runs_out_of_memory_says_so(tmp_path, monkeypatch):
    """Seen in the thirteenth session: the fp8-dflash2 expert's rank 0 ran out of its virtual card
    allocating the KV cache, and the row's refusal was "Engine core initialization failed". It is
    the worker's out-of-memory line now."""

    oom = ("(Worker_PP0 pid=3413) ERROR 12-02 04:39:26 [multiproc_executor.py:1189] torch.OutOfMemoryError: "
           "CUDA out of memory. Tried to allocate 3.64 GiB.")

    def fails(kwargs, job, *, log, timeout, env):
        log.write_text(oom + "\nRuntimeError: Engine core initialization failed. See root cause above.\n")
        return {"error": "RuntimeError: Engine core initialization failed.", "timed_out": False, "log": log}

    monkeypatch.setattr(hl, "ProcessPeaks", NoPeaks)
    monkeypatch.setattr(hl, "run_llm", fails)
    r = hl.run_arm(hl.Arm("fp8-dflash2/expert", "expert", "fp8-dflash2", {}, {}), tmp_path, lambda llm: {}, 300)
    assert "OutOfMemoryError" in hl.headline_row(r)["refusal"] and "Worker_PP0" in hl.headline_row(r)["refusal"]


@pytest.mark.parametrize("kinds,expected", [({"plugin"}, ["plugin"]), ({"expert", "plugin"}, ["expert", "plugin"])])
def test_run_launcher_runs_every_asked_arm(tmp_path, monkeypatch, kinds, expected):
    """Seen on the GPU: `--arms plugin` ran nothing and wrote an empty table."""
    ran = []
    monkeypatch.setattr(hl, "run_arm", lambda arm, *a, **k: ran.append(arm.kind) or {"booted": True})
    monkeypatch.setattr(hl, "save_all", lambda out: [])
    hl.run_launcher("fp8-mtp", tmp_path, kinds, TOTAL, hl.VIRTUAL, models=tmp_path / "models")
    assert ran == expected


def test_split_arms_alone_start_from_the_plans_split(tmp_path, monkeypatch, capsys):
    """Seen on the GPU (2026-12-04): `--arms split` in an output folder without the plugin arm's
    result ran nothing and printed an empty table. The plugin booted at 19/45 for fp8-mtp on the
    virtual pair that day; the split arms then run 17/47 and 21/43 (and the expert's 20/44)."""
    ran = []
    monkeypatch.setattr(hl, "run_arm", lambda arm, *a, **k: ran.append(arm.env["VLLM_PP_LAYER_PARTITION"]) or {})
    monkeypatch.setattr(hl, "save_all", lambda out: [])
    hl.run_launcher("fp8-mtp", tmp_path, {"split"}, TOTAL, hl.VIRTUAL, models=tmp_path / "models")
    assert sorted(ran) == ["17,47", "20,44", "21,43"], ran
    assert "no plugin arm in" in capsys.readouterr().out


def test_split_arms_alone_on_two_gpus_say_why_nothing_ran(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(hl, "run_arm", lambda arm, *a, **k: ran.append(arm.name) or {})
    monkeypatch.setattr(hl, "save_all", lambda out: [])
    hl.run_launcher("fp8-mtp", tmp_path, {"split"}, TOTAL, None, models=tmp_path / "models")
    assert ran == []
    out = capsys.readouterr().out
    assert "split arms" in out and "--arms plugin" in out, out


def test_the_arms_end_with_one_image_of_four_megapixels():
    """Rank 0's other peak: the vision encoder's pass over a ~4 MP image with the KV cache
    allocated (the plan charges it; the fifth run's arms sent no image). Last, so a failure there
    costs no other measurement; the placeholder is the one the reference tokenizer carries."""
    from gpu_models import VISION_TOKENS

    seen = []

    class Out:
        prompt_token_ids = list(range(4100))

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            seen.append((prompts, params))
            return [Out()]

    assert hl.MEASURES[-1] == "image"
    r = hl.image_turn(FakeLLM())
    (prompts, params), = seen
    image = prompts[0]["multi_modal_data"]["image"]
    assert image.size == (2048, 2048) and image.mode == "RGB"
    assert all(t in prompts[0]["prompt"] for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    assert set(("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")) <= set(VISION_TOKENS)
    assert params.max_tokens == 1 and params.temperature == 0
    assert r["pixels"] == 4_194_304 and r["prompt_tokens"] == 4100 and r["ttft_s"] >= 0


def test_each_pass_has_its_own_peak_per_rank():
    """2026-12-04: FP8 + DFlash2's rank 0 peaked 66 MiB above the plan, and the arm's one peak a
    rank could not say which pass reached it. The samples are split by the measured passes'
    wall-clock windows: before the first one is the boot."""
    pids = {101: 0, 202: 1}
    mib = 2**20
    samples = [(1.0, 101, 900 * mib), (1.0, 202, 2000 * mib),   # boot
               (5.0, 101, 1000 * mib), (5.5, 202, 2500 * mib),  # the long prompt
               (9.0, 101, 1200 * mib), (9.0, 202, 2100 * mib),  # the image
               (9.5, 303, 9999 * mib)]                          # not a worker
    phases = {"long": [4.0, 6.0], "image": [8.0, 10.0]}
    assert hl.phase_peaks_mib(pids, samples, phases) == {
        "boot": [900, 2000], "long": [1000, 2500], "image": [1200, 2100]}
    assert hl.phase_peaks_mib(pids, samples, {}) == {}  # no pass measured (a refusal): nothing to split


def test_measure_records_each_pass_window(monkeypatch):
    """What phase_peaks_mib splits by: measure writes each pass's start and end."""
    class Cfg:
        cache_config = type("C", (), {"num_gpu_blocks": 10, "block_size": 16})
        model_config = type("M", (), {"max_model_len": 4096})

    calls = []
    llm = type("L", (), {"llm_engine": type("E", (), {"vllm_config": Cfg}),
                         "collective_rpc": lambda self, fn: calls.append(fn) or [{"reserved": len(calls)}] * 2})()
    monkeypatch.setattr(hl, "timed", lambda llm, ids, n: {"tokens": [1]})
    monkeypatch.setattr(hl, "decode_at", lambda llm, ids: {"decode_ms_per_step": 1.0})
    res = hl.measure(llm, deadline=hl.time.time() + 60, parts=("short", "mid"))
    assert list(res["phase_s"]) == ["greedy", "short", "mid"]
    # torch's allocator asked of every rank after the boot and after each measured pass, in order
    assert res["torch_mib"] == {"boot": [{"reserved": 1}] * 2, "short": [{"reserved": 2}] * 2,
                                "mid": [{"reserved": 3}] * 2}
    assert calls == [hl.worker_torch_memory] * 3
    assert all(t0 <= t1 for t0, t1 in res["phase_s"].values())
    assert res["phase_s"]["greedy"][1] <= res["phase_s"]["short"][0] <= res["phase_s"]["mid"][0]


def test_torch_memory_reaches_a_process_that_cannot_import_the_script(tmp_path):
    """The workers (spawned by vLLM) have no benchmarks/ on their path: the function must travel
    by value, and answer there with torch's figures for the rank."""
    import subprocess
    import sys

    import cloudpickle

    sent = []

    class LLM:
        def collective_rpc(self, fn):
            sent.append(cloudpickle.dumps(fn))
            return ["answered"]

    assert hl.torch_memory_mib(LLM()) == ["answered"]
    code = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(sorted(f(None).items()))"
    out = subprocess.run([sys.executable, "-c", code], input=sent[0], capture_output=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-800:]
    # a CPU-only torch: no CUDA memory held
    assert out.stdout.decode().strip() == "[('max_allocated', 0), ('max_reserved', 0), ('reserved', 0)]"


def test_torch_memory_failure_is_recorded_not_raised():
    class LLM:
        def collective_rpc(self, fn):
            raise RuntimeError("engine core gone")

    assert hl.torch_memory_mib(LLM()) == {"error": "RuntimeError: engine core gone"}
