"""scripts/gpu/embed_quant_pp.py: the packed format, the CPU dry run, the checks applied to a GPU
run's facts, and the parent's arms with stand-in children.

The dry run imports vLLM (and, without torchvision, stubs it): it runs in a subprocess, once per
module, so nothing leaks into the other tests."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import GPU_SCRIPTS, gpu_script_dry_run, load_gpu_script, process_gone, use_stand_in_children

SCRIPT = GPU_SCRIPTS / "embed_quant_pp.py"


@pytest.fixture(scope="module")
def script():
    return load_gpu_script("embed_quant_pp")


@pytest.fixture(scope="module")
def dry_run_dir(tmp_path_factory):
    return gpu_script_dry_run("embed_quant_pp", tmp_path_factory.mktemp("embedq-dry-run"), timeout=240)


# --- the packed format -----------------------------------------------------------------------------


def test_pack_layout_is_the_kernels(script):
    """Value c at bits 8 * (c % 4) of word c // 4, stored + 128 (compressed-tensors' pack_to_int32)."""
    q = torch.tensor([[1, 2, -128, 127]], dtype=torch.int32)
    word = 129 | 130 << 8 | 0 << 16 | 255 << 24
    assert script.pack(q).tolist() == [[word - 2**32]]
    assert torch.equal(script.unpack(script.pack(q), 4), q)


def test_quantize_round_trips_and_dequantizes_exactly(script):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    q, scale = script.quantize(w)
    assert scale.shape == (64, 256 // script.GROUP) and scale.dtype == torch.bfloat16
    assert int(q.abs().max()) <= script.QMAX
    packed = script.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (64, 256 // script.PACK)
    assert torch.equal(script.unpack(packed, 256), q)
    table = script.dequantize(packed, scale, 256)
    assert table.dtype == torch.bfloat16
    # Power-of-two scales: the float32 product is already a bf16 value, so no rounding mode matters.
    exact = q.float() * scale.float().repeat_interleave(script.GROUP, dim=1)
    assert torch.equal(table.float(), exact)
    assert (table.float() - w.float()).abs().max() <= scale.float().max()  # a quantization, not noise


# --- dry run -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_checks_the_checkpoints_and_configs(dry_run_dir, script):
    result = json.loads((dry_run_dir / "embed_quant_pp.json").read_text())
    assert result["ok"] and all(result["checks"].values()), result["checks"]
    qcfg = json.loads((dry_run_dir / "quantized" / "config.json").read_text())
    dcfg = json.loads((dry_run_dir / "dense" / "config.json").read_text())
    assert qcfg.pop("quantization_config") == script.QUANT_CONFIG and qcfg == dcfg
    assert dcfg["mtp_num_hidden_layers"] == 1 and "quantization_config" not in dcfg
    methods = result["quant_config"]["methods"]
    assert methods["model.embed_tokens"] == methods["mtp.embed_tokens"] == script.EMBED_METHOD
    exp = result["expected"]
    assert exp["param_bytes"]["weight_packed"] * 2 == exp["bf16_table_bytes"]  # int8: half a bf16 table
    assert exp["embedding_bytes"] < exp["bf16_table_bytes"]
    assert [result["engine"][a]["executor"] for a in script.ARMS] == ["DualGpuExecutor", "DualGpuExecutor", "mp"]
    for name in ("model.safetensors", "model-mtp.safetensors"):
        assert (dry_run_dir / "quantized" / name).exists() and (dry_run_dir / "dense" / name).exists()


# --- checks on synthetic child results ----------------------------------------------------------------

LINE = ("(Worker_PP{rank} pid={pid}) INFO x [plugin.py:112] vllm-dualgpu 0.1.0 (worker, pid {pid}, vLLM 0.30.0): "
        "applied pp-inflight-batches, {patches}; skipped {skipped}")
REFUSAL = ("(Worker_PP0 pid=7) ValueError: There is no module or parameter named 'embed_tokens.weight_packed' in "
           "Qwen3_5Model. The available parameters belonging to embed_tokens (VocabParallelEmbedding) are: "
           "{'embed_tokens.weight'}")
EXPECTED = {"embedding_bytes": 2129936, "bf16_table_bytes": 4194304, "dense_table_sha256": "ab" * 32}


def embed(script, packed: bool = True) -> dict:
    if packed:
        return {"class": "VocabParallelEmbedding", "quant_method": script.EMBED_METHOD, "has_weight": False,
                "bytes": EXPECTED["embedding_bytes"], "params": {"weight_packed": ["int32", [4096, 128]]}}
    return {"class": "VocabParallelEmbedding", "quant_method": "UnquantizedEmbeddingMethod", "has_weight": True,
            "bytes": EXPECTED["bf16_table_bytes"], "params": {"weight": ["bfloat16", [4096, 512]]}}


def plugin_arm(script, packed: bool) -> dict:
    def worker(rank):
        w = {"pp_rank": rank, "use_v2_model_runner": True, "target": embed(script, packed),
             "lookup": {"sha256": EXPECTED["dense_table_sha256"]}}
        if rank == 1:
            w.update(drafter="Qwen3_5MTP", drafter_embed=embed(script, packed), drafter_embed_is_target_embed=True)
        return w

    outputs = [[5 + i + j for j in range(script.MAX_TOKENS)] for i in range(len(script.prompts()))]
    return {"child": {"booted": True, "outputs": outputs, "workers": [worker(1), worker(0)]},
            "plugin_lines": [LINE.format(rank=r, pid=10 + r, patches=script.PATCH, skipped="none") for r in (0, 1)]
            + ["vllm-dualgpu 0.1.0 (engine, pid 9, vLLM 0.30.0): applied pp-inflight-batches; skipped none"],
            "refusal_lines": []}


def good_arms(script) -> dict:
    return {"plugin-quantized": plugin_arm(script, True), "plugin-dense": plugin_arm(script, False),
            "stock-quantized": {"child": {"booted": False, "error": "RuntimeError: Engine core initialization failed."},
                                "plugin_lines": [], "refusal_lines": [REFUSAL]}}


def test_checks_pass_on_a_good_run(script):
    assert all(script.checks(good_arms(script), EXPECTED).values())


def _q_worker(rank):
    return lambda a: next(w for w in a["plugin-quantized"]["child"]["workers"] if w["pp_rank"] == rank)


@pytest.mark.parametrize(
    "breakage, failed",
    [
        (lambda s, a: _q_worker(0)(a)["target"].update(embed(s, packed=False) | {"bytes": EXPECTED["embedding_bytes"]}),
         ["every rank's target embedding is CompressedTensorsEmbeddingWNA16Int, no dense weight"]),
        (lambda s, a: _q_worker(1)(a)["target"].update(has_weight=True),
         ["every rank's target embedding is CompressedTensorsEmbeddingWNA16Int, no dense weight"]),
        (lambda s, a: _q_worker(0)(a)["target"].update(bytes=EXPECTED["bf16_table_bytes"]),
         ["embedding bytes per rank are the packed size"]),
        (lambda s, a: _q_worker(1)(a).update(drafter_embed_is_target_embed=False),
         ["MTP drafter on the last rank looks up the target's packed embedding"]),
        (lambda s, a: _q_worker(1)(a)["lookup"].update(sha256="cd" * 32),
         ["every rank's packed lookup equals the dense table bitwise"]),
        (lambda s, a: _q_worker(1)(a).update(lookup={"error": "RuntimeError: no kernel"}),
         ["every rank's packed lookup equals the dense table bitwise"]),
        (lambda s, a: a["plugin-quantized"]["child"]["outputs"][2].__setitem__(7, 4000),
         ["quantized tokens equal the dense arm's"]),
        (lambda s, a: a["plugin-quantized"]["plugin_lines"].__setitem__(
            1, LINE.format(rank=1, pid=11, patches="x", skipped=f"{s.PATCH} (target moved)")),
         ["workers applied qwen3-next-embed-quant-config"]),
        (lambda s, a: a["stock-quantized"].update(child={"booted": True, "outputs": [[1]]}, refusal_lines=[]),
         ["stock refused with the weight_packed message"]),
        (lambda s, a: a["stock-quantized"].update(refusal_lines=[]),  # failed, but not for the packed weights
         ["stock refused with the weight_packed message"]),
        (lambda s, a: a["stock-quantized"].update(child=None),  # no result: a hang, not a refusal
         ["stock refused with the weight_packed message"]),
        (lambda s, a: a["plugin-dense"]["child"].update(error="RuntimeError: boom", outputs=None),
         ["quantized tokens equal the dense arm's"]),
        (lambda s, a: a["plugin-quantized"]["child"].update(error="RuntimeError: boom"),
         ["quantized arm generated", "quantized tokens equal the dense arm's"]),
    ],
)
def test_checks_fail_on_a_bad_run(script, breakage, failed):
    arms = good_arms(script)
    breakage(script, arms)
    assert [k for k, v in script.checks(arms, EXPECTED).items() if not v] == failed


def test_one_rank_probed_fails_the_per_rank_checks(script):
    arms = good_arms(script)
    arms["plugin-quantized"]["child"]["workers"].pop()  # rank 0
    failed = {k for k, v in script.checks(arms, EXPECTED).items() if not v}
    assert {"two ranks probed", "embedding bytes per rank are the packed size",
            "every rank's packed lookup equals the dense table bitwise"} <= failed


def test_stock_refusal_matches_vllms_message(script):
    import re

    assert re.search(script.STOCK_REFUSAL, REFUSAL)
    for name in ("weight_scale", "weight_shape"):  # whichever packed tensor the loader meets first
        assert re.search(script.STOCK_REFUSAL, REFUSAL.replace("weight_packed", name))
    assert not re.search(script.STOCK_REFUSAL, "There is no module or parameter named 'lm_head.weight_packed'")


def test_token_comparison_reports_the_gap_where_tokens_part(script):
    arms = good_arms(script)
    q, d = arms["plugin-quantized"]["child"], arms["plugin-dense"]["child"]
    q["outputs"][1][3] = 99
    d["logprobs"] = [[[[t, -0.5], [99, -0.52]] for t in out] for out in d["outputs"]]
    q["logprobs"] = [[[[t, -0.5], [t + 1, -0.6]] for t in out] for out in q["outputs"]]
    cmp = script.token_comparison(arms)
    assert not cmp["ok"] and cmp["identical"] == len(script.prompts()) - 1
    (m,) = cmp["mismatches"]
    assert (m["prompt"], m["first_diff"], m["got_token"]) == (1, 3, 99) and m["gap_ref"] == pytest.approx(0.02)
    arms["plugin-quantized"]["child"] = None
    assert script.token_comparison(arms) is None


# --- the parent: arms, time limits, process groups (stand-in children, no vLLM) ---------------------


@pytest.fixture
def no_process_hooks(script, monkeypatch):
    """parent() installs exit and signal handlers; keep them out of the pytest process."""
    monkeypatch.setattr(script, "kill_running_on_exit", lambda: None)
    monkeypatch.setattr(script, "expected_facts", lambda dirs: dict(EXPECTED))


@pytest.fixture
def fake_children(script, tmp_path, monkeypatch, no_process_hooks):
    """run_arm starts a stand-in child (same argv as the real child) instead of vLLM; no NVML."""
    payload_file = tmp_path / "payload.json"
    use_stand_in_children(monkeypatch, SCRIPT, payload_file, expected_env=script.CHILD_ENV)
    import gpurun

    def no_nvml():
        raise RuntimeError("no NVML here")

    monkeypatch.setattr(gpurun, "NvmlSampler", no_nvml)

    def set_payload(arms: dict):
        payload_file.write_text(json.dumps({
            arm: {"result": r["child"], "log": r["plugin_lines"] + r["refusal_lines"], "hang": r.get("hang", False)}
            for arm, r in arms.items()}))

    return set_payload


def test_parent_runs_every_arm(script, fake_children, tmp_path):
    fake_children(good_arms(script))
    assert script.parent(tmp_path, script.checkpoint_dirs(tmp_path), 60) == 0
    result = json.loads((tmp_path / "embed_quant_pp.json").read_text())
    assert result["ok"] and list(result["arms"]) == list(script.ARMS)
    assert result["tokens"]["ok"] and result["expected"] == EXPECTED
    arms = result["arms"]
    assert arms["stock-quantized"]["engine_kwargs"]["distributed_executor_backend"] == "mp"
    assert arms["plugin-dense"]["engine_kwargs"]["model"] == "OUTDIR/dense"
    assert arms["stock-quantized"]["refusal_lines"] and "no NVML" in arms["plugin-quantized"]["nvml_error"]
    for arm in script.ARMS:
        assert (tmp_path / f"{arm}-child.json").exists() and (tmp_path / f"{arm}-llm.log").exists()


def test_parent_fails_when_stock_boots(script, fake_children, tmp_path):
    arms = good_arms(script)
    arms["stock-quantized"] = plugin_arm(script, False)
    fake_children(arms)
    assert script.parent(tmp_path, script.checkpoint_dirs(tmp_path), 60) == 1
    result = json.loads((tmp_path / "embed_quant_pp.json").read_text())
    assert [k for k, v in result["checks"].items() if not v] == ["stock refused with the weight_packed message"]


def test_arm_time_limit_kills_the_process_group(script, fake_children, tmp_path):
    arms = good_arms(script)
    arms["stock-quantized"]["hang"] = True
    fake_children(arms)
    result = script.run_arm(tmp_path, script.checkpoint_dirs(tmp_path), "stock-quantized", 3)
    assert result["timed_out"] and result["child"] is None and result["time_limit_s"] == 3
    assert process_gone(int((tmp_path / "grandchild.pid").read_text()))


def test_later_arms_keep_their_minimum(script, monkeypatch, tmp_path, no_process_hooks):
    limits = {}

    def run_arm(out, model_dirs, arm, timeout):
        limits[arm] = timeout
        return {"child": None, "plugin_lines": [], "refusal_lines": []}

    monkeypatch.setattr(script, "run_arm", run_arm)
    assert script.parent(tmp_path, script.checkpoint_dirs(tmp_path), 260) == 1  # no results: the checks fail
    assert limits["plugin-quantized"] == pytest.approx(260 - 110 - 100, abs=1)
    assert limits["plugin-dense"] == pytest.approx(260 - 100, abs=1)
    assert limits["stock-quantized"] == pytest.approx(260, abs=1)
