"""scripts/gpu/spec_decode_pp.py: the CPU dry run and the checks applied to a GPU run's facts.

The dry run imports vLLM (and, without torchvision, stubs it): it runs in a subprocess, once per
module for the default ``--method both``, so nothing leaks into the other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import GPU_SCRIPTS, gpu_script_dry_run, load_gpu_script, process_gone, use_stand_in_children

SCRIPT = GPU_SCRIPTS / "spec_decode_pp.py"


@pytest.fixture(scope="module")
def script():
    return load_gpu_script("spec_decode_pp")


@pytest.fixture(scope="module")
def dry_run_dir(tmp_path_factory):
    """OUTDIR of one default dry run (``--method both``)."""
    return gpu_script_dry_run("spec_decode_pp", tmp_path_factory.mktemp("spec-dry-run"), timeout=240)


def test_dry_run_builds_the_engine_config(dry_run_dir):
    tmp_path = dry_run_dir
    result = json.loads((tmp_path / "spec_decode_pp.json").read_text())
    assert result["ok"] and all(result["checks"].values())
    facts = result["facts"]
    assert facts["draft_architectures"] == ["Qwen3_5MTP"]
    assert facts["executor"] == "DualGpuExecutor" and facts["pipeline_parallel_size"] == 2
    assert facts["is_hybrid"] and facts["mamba_cache_mode"] == "align"
    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    layer_kinds = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    assert layer_kinds >= 2 and cfg["num_hidden_layers"] % 2 == 0  # attention on both PP ranks


def good_run(script) -> dict:
    line = "INFO x [plugin.py:46] vllm-dualgpu 0.1.0 ({}, vLLM 0.30.0): applied executor-by-name, {}; skipped none"
    return {
        "child": {
            "outputs": [[1]] * len(script.prompts()),
            "workers": [
                {"pp_rank": 1, "max_concurrent_batches": 2, "drafter": "Qwen3_5MTP",
                 "drafter_embed_is_target_embed": True},
                {"pp_rank": 0, "max_concurrent_batches": 2},
            ],
        },
        "plugin_lines": [
            line.format("frontend", "x"),
            line.format("engine", ", ".join(script.ENGINE_PATCHES)),
            line.format("worker", ", ".join(script.WORKER_PATCHES)),
            line.format("worker", ", ".join(script.WORKER_PATCHES)),
        ],
    }


def test_checks_pass_on_a_good_run(script):
    assert all(script.checks(good_run(script)).values())


@pytest.mark.parametrize(
    "breakage, failed",
    [
        (lambda r: r["child"]["workers"][0].update(max_concurrent_batches=3),
         "workers see max_concurrent_batches == pp_size"),
        (lambda r: r["child"]["workers"][0].update(drafter_embed_is_target_embed=False),
         "drafter embedding is the target's"),
        (lambda r: r["plugin_lines"].__setitem__(1, r["plugin_lines"][1].replace("pp-inflight-batches", "")),
         "engine applied its issue #6 patches"),
        (lambda r: r["plugin_lines"].__setitem__(3, r["plugin_lines"][3].replace("drafter-shares", "x")),
         "workers applied their issue #6 patches"),
        (lambda r: r["child"]["workers"][1].update(drafter="X"), "drafter on the last rank only"),
    ],
)
def test_checks_catch_each_failure(script, breakage, failed):
    run = good_run(script)
    breakage(run)
    result = script.checks(run)
    assert not result[failed]
    assert sum(not v for v in result.values()) == 1


# --- EAGLE3 arm: dry run ---------------------------------------------------------------------------


def test_dry_run_covers_the_eagle3_arm(dry_run_dir, script):
    result = json.loads((dry_run_dir / "spec_decode_pp.json").read_text())
    drafter = json.loads((dry_run_dir / "drafter-eagle3" / "config.json").read_text())
    target = json.loads((dry_run_dir / "model" / "config.json").read_text())
    assert drafter == script.EAGLE3_CONFIG
    assert drafter["hidden_size"] == target["hidden_size"] and drafter["vocab_size"] == target["vocab_size"]
    assert drafter["eagle_aux_hidden_state_layer_ids"] == drafter["eagle_config"]["eagle_aux_hidden_state_layer_ids"]

    e3 = result["eagle3"]
    assert all(e3["checks"].values()), e3
    facts = e3["facts"]
    assert facts["spec_method"] == "eagle3" and facts["num_speculative_tokens"] == 2
    assert facts["draft_model_class"] == "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
    assert facts["executor"] == "DualGpuExecutor" and facts["pipeline_parallel_size"] == 2
    assert facts["aux_layers"] == [2, 4, 5]
    assert facts["aux_layer_ranks"] == {"2": 0, "4": 0, "5": 1}  # two states relayed to rank 1
    assert facts["preflight"] == {"warnings": []} and facts["aux_relay_problem"] == ""
    assert facts["v2_runner_blockers"] == []

    stock = result["stock_eagle3"]
    assert all(stock["checks"].values()), stock
    assert stock["facts"]["config"] == "accepted" and stock["facts"]["executor"] == "mp"
    assert stock["facts"]["worker_check"] == (
        "refused: Qwen3_5ForCausalLM does not support eagle3 with pipeline parallelism")
    # Every arm's checks count for the exit code.
    for name in list(e3["checks"]) + list(stock["checks"]):
        assert any(k.endswith(name) for k in result["checks"])


BROKEN_DRAFTERS = r"""
import importlib.util, json, os, sys
from pathlib import Path
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
spec = importlib.util.spec_from_file_location("sdp", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
out = Path(sys.argv[2])
model = m.write_model(out)
m._cpu_inspection_shim()
good, engine_kwargs = dict(m.EAGLE3_CONFIG), m.engine_kwargs
res = {}
for name, change in json.loads(sys.argv[3]).items():
    m.EAGLE3_CONFIG = {**good, **change.get("config", {})}
    def kwargs(model, arm="mtp", drafter=None, change=change):
        kw = engine_kwargs(model, arm, drafter)
        kw["speculative_config"].update(change.get("spec", {}))
        kw.update(change.get("engine", {}))
        return kw
    m.engine_kwargs = kwargs
    drafter = m.write_drafter(out / name)
    try:
        res[name] = sorted(k for k, v in m.dry_run_eagle3(model, drafter)["checks"].items() if not v)
    except Exception as exc:
        res[name] = f"{type(exc).__name__}: {exc}"[:300]
print("RESULT " + json.dumps(res))
"""

# Each wrong drafter config or speculative setting, and the dry-run checks it must fail.
BROKEN = {
    "as written": ({}, []),
    "narrower than the target": ({"config": {"hidden_size": 512}}, ["drafter width and vocab are the target's"]),
    "smaller draft vocab": ({"config": {"draft_vocab_size": 4096}}, ["drafter width and vocab are the target's"]),
    "aux states on rank 1 only": (
        {"config": {"eagle_aux_hidden_state_layer_ids": [5, 6, 7],
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 6, 7]}}},
        ["aux layers from the drafter config", "aux states captured on both ranks"]),
    "fc sized for 3 states, 2 requested": (
        {"config": {"eagle_aux_hidden_state_layer_ids": [2, 5], "eagle_config": {}}},
        ["aux layers from the drafter config"]),
    "another drafter class": ({"config": {"architectures": ["Eagle3Qwen3ForCausalLM"], "model_type": "qwen3"}},
                              ["eagle3 drafter"]),
    "3 speculative tokens": ({"spec": {"num_speculative_tokens": 3}}, ["num_speculative_tokens"]),
    "stock executor": ({"engine": {"distributed_executor_backend": "mp"}}, ["dualgpu executor"]),
}


def test_dry_run_fails_on_a_wrong_drafter_or_setting(tmp_path):
    variants = {name: change for name, (change, _) in BROKEN.items()}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-c", BROKEN_DRAFTERS, str(SCRIPT), str(tmp_path), json.dumps(variants)],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = json.loads(lines[-1][len("RESULT "):])
    assert failed == {name: expected for name, (_, expected) in BROKEN.items()}


def test_method_and_timeout_arguments(script, tmp_path):
    assert script.arms_of("both") == ("mtp", "eagle3", "stock-eagle3")
    assert script.arms_of("mtp") == ("mtp",) and script.arms_of("eagle3") == ("eagle3", "stock-eagle3")
    assert script.default_timeout("mtp") == 210 and script.default_timeout("both") <= 240
    assert script.engine_kwargs(tmp_path / "model") == script.engine_kwargs(tmp_path / "model", "mtp")
    e3 = script.engine_kwargs(tmp_path / "model", "eagle3")
    assert e3["speculative_config"] == {"method": "eagle3", "model": str(tmp_path / "drafter-eagle3"),
                                        "num_speculative_tokens": 2}
    assert e3["distributed_executor_backend"] == "dualgpu" and e3["pipeline_parallel_size"] == 2
    stock = script.engine_kwargs(tmp_path / "model", "stock-eagle3")
    assert stock == {**e3, "distributed_executor_backend": "mp"}
    # The MTP arm's settings are what they were before the EAGLE3 arm.
    mtp = script.engine_kwargs(tmp_path / "model")
    assert mtp["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2} and "disable_log_stats" not in mtp


def test_aux_layer_ranks(script):
    assert script.aux_layer_ranks([2, 4, 5], [(0, 4), (4, 8)]) == {2: 0, 4: 0, 5: 1}
    assert script.aux_layer_ranks([0, 3, 8], [(0, 3), (3, 8)]) == {0: 0, 3: 0, 8: 1}


# --- EAGLE3 arm: checks on a GPU run's facts -------------------------------------------------------


def rank_line(rank: int, device_phase: list[tuple[str, str]]) -> str:
    """A rank's summary line as the worker logs it, with the device phase noted by the plugin."""
    from conftest import registry_patch
    from vllm_dualgpu import plugin
    from vllm_dualgpu.engine import rank_summary
    from vllm_dualgpu.patching.core import Outcome

    rank_summary.clear()
    try:
        rank_summary.note("GPU", f"NVIDIA H200 (cuda:{rank})")
        rank_summary.note("budget", "10.00 GiB = 11.00 GiB free - 1.00 GiB reserve")
        plugin._note_device_phase([Outcome(registry_patch(n), status) for n, status in device_phase])
        rank_summary.note("layers", "even split")
        rank_summary.note("KV", "1.00 GiB, 100 blocks x 128 tokens")
        return "INFO x [worker.py:229] " + rank_summary.line(f"vllm-dualgpu rank {rank}/2: ")
    finally:
        rank_summary.clear()


def good_eagle3_run(script) -> dict:
    from vllm_dualgpu.patching.core import APPLIED

    line = "INFO x [plugin.py:46] vllm-dualgpu 0.1.0 ({}, pid 1, vLLM 0.30.0): applied {}; skipped none"
    phase = [(n, APPLIED) for n in script.DEVICE_PATCHES]
    return {
        "child": {
            "outputs": [[1]] * len(script.prompts()),
            "workers": [
                {"pp_rank": 1, "drafter": "Eagle3LlamaForCausalLM", "aux_hidden_state_layers": [2, 4, 5],
                 "supports_aux_hidden_states_over_pp": True, "aux_slot_base": 2, "decoder_layers": [4, 8]},
                {"pp_rank": 0, "aux_hidden_state_layers": [2, 4, 5], "supports_aux_hidden_states_over_pp": True,
                 "aux_slot_base": 0, "decoder_layers": [0, 4]},
            ],
        },
        "plugin_lines": [
            line.format("engine", ", ".join(script.ENGINE_PATCHES)),
            line.format("worker", ", ".join(script.EAGLE3_WORKER_PATCHES + ("drafter-shares-target-embed",))),
            line.format("worker", ", ".join(script.EAGLE3_WORKER_PATCHES)),
        ],
        "rank_lines": [rank_line(0, phase), rank_line(1, phase)],
    }


def test_eagle3_checks_pass_on_a_good_run(script):
    run = good_eagle3_run(script)
    assert "patched once the device was set: qwen3-next-aux-hidden-relay, qwen3-5-aux-hidden-layers" in run["rank_lines"][0]
    assert script.device_phase_patches(run["rank_lines"]) == {r: list(script.DEVICE_PATCHES) for r in (0, 1)}
    assert all(script.eagle3_checks(run).values()), script.eagle3_checks(run)


def _skip_layers_patch(run, script):
    from vllm_dualgpu.patching.core import APPLIED, SKIPPED

    run["rank_lines"][1] = rank_line(1, [(script.DEVICE_PATCHES[0], APPLIED), (script.DEVICE_PATCHES[1], SKIPPED)])


@pytest.mark.parametrize(
    "breakage, failed",
    [
        (lambda r, s: r["child"].update(outputs=[[1]]), "generated"),
        (lambda r, s: r["child"]["workers"].pop(), ("two ranks probed", "both decoders relay the aux states")),
        (lambda r, s: r["child"]["workers"][0].update(drafter="Qwen3_5MTP"), "eagle3 drafter on the last rank only"),
        (lambda r, s: r["child"]["workers"][1].update(supports_aux_hidden_states_over_pp=False),
         "both decoders relay the aux states"),
        (lambda r, s: r["child"]["workers"][0].update(aux_slot_base=1), "both decoders relay the aux states"),
        (lambda r, s: r["rank_lines"].pop(), "rank lines list the device-phase patches"),
        (_skip_layers_patch, "rank lines list the device-phase patches"),
        (lambda r, s: r["plugin_lines"].__setitem__(2, r["plugin_lines"][2].replace("qwen3-next-aux-hidden-flag", "")),
         "workers applied the relay flag"),
        (lambda r, s: r["plugin_lines"].pop(0), "engine applied its issue #6 patches"),
    ],
)
def test_eagle3_checks_catch_each_failure(script, breakage, failed):
    run = good_eagle3_run(script)
    breakage(run, script)
    result = script.eagle3_checks(run)
    assert {k for k, v in result.items() if not v} == ({failed} if isinstance(failed, str) else set(failed))


def test_stock_checks(script):
    refusal = "(Worker_PP1 pid=9) ValueError: Qwen3_5ForCausalLM does not support eagle3 with pipeline parallelism"
    assert all(script.stock_checks({"child": {"booted": False, "error": "RuntimeError: x"},
                                    "refusal_lines": [refusal]}).values())
    assert not script.stock_checks({"child": {"booted": False, "error": "RuntimeError: x"},
                                    "refusal_lines": []})["refused with vLLM's PP message"]
    assert not script.stock_checks({"child": {"booted": True}, "refusal_lines": [refusal]})["did not boot"]
    assert not script.stock_checks({"child": None, "refusal_lines": [refusal]})["did not boot"]  # hung


def test_acceptance_from_vllm_metric_names(script):
    metrics = {"vllm:spec_decode_num_drafts": 40, "vllm:spec_decode_num_draft_tokens": 80,
               "vllm:spec_decode_num_accepted_tokens": 20, "vllm:spec_decode_num_accepted_tokens_per_pos": [15, 5]}
    acc = script.acceptance(metrics)
    assert acc["acceptance_rate"] == 0.25 and acc["mean_acceptance_length"] == 1.5
    assert acc["accepted_per_position"] == [15, 5] and acc["drafts"] == 40
    assert script.acceptance({}) == {"drafts": None, "draft_tokens": None, "accepted_tokens": None,
                                     "accepted_per_position": None}


# --- the parent: arms, time limits, process groups (stand-in children, no vLLM) ---------------------


@pytest.fixture
def no_process_hooks(script, monkeypatch):
    """parent() installs exit and signal handlers; keep them out of the pytest process."""
    monkeypatch.setattr(script, "kill_running_on_exit", lambda: None)


class NoNvml:
    def __init__(self):
        self.peak_device, self.peak_process = [], {}

    def sample(self):
        return {"device_used": [], "processes": {}}


@pytest.fixture
def fake_children(script, tmp_path, monkeypatch, no_process_hooks):
    """run_arm starts a stand-in child (same argv as the real child) instead of vLLM."""
    payload_file = tmp_path / "payload.json"
    use_stand_in_children(monkeypatch, SCRIPT, payload_file)
    monkeypatch.setattr(script, "ProcessMemory", NoNvml)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: type("R", (), {"stdout": ""})())  # nvidia-smi

    def set_payload(payload: dict):
        payload_file.write_text(json.dumps(payload))

    return set_payload


def good_payload(script) -> dict:
    mtp, e3 = good_run(script), good_eagle3_run(script)
    refusal = "(Worker_PP0 pid=9) ValueError: Qwen3_5ForCausalLM does not support eagle3 with pipeline parallelism"
    return {
        "mtp": {"file": "child.json", "result": mtp["child"], "log": mtp["plugin_lines"]},
        "eagle3": {"file": "eagle3-child.json", "result": e3["child"], "log": e3["plugin_lines"] + e3["rank_lines"]},
        "stock-eagle3": {"file": "stock-eagle3-child.json", "log": [refusal],
                         "result": {"booted": False, "error": "RuntimeError: Engine core initialization failed."}},
    }


def test_parent_runs_every_arm_and_merges_checks(script, fake_children, tmp_path):
    fake_children(good_payload(script))
    model = script.write_model(tmp_path)
    assert script.parent(tmp_path, model, 60, "both") == 0
    result = json.loads((tmp_path / "spec_decode_pp.json").read_text())
    assert result["ok"] and result["method"] == "both"
    assert result["child"]["workers"][0]["pp_rank"] == 1  # the MTP arm stays at the top level
    assert result["eagle3"]["ok"] and result["stock_eagle3"]["ok"]
    assert result["eagle3"]["engine_kwargs"]["speculative_config"]["model"] == "OUTDIR/drafter-eagle3"
    assert result["stock_eagle3"]["engine_kwargs"]["distributed_executor_backend"] == "mp"
    assert result["stock_eagle3"]["refusal_lines"]
    assert "eagle3: rank lines list the device-phase patches" in result["checks"]
    assert "stock: refused with vLLM's PP message" in result["checks"] and all(result["checks"].values())


def test_parent_mtp_only_writes_the_mtp_result(script, fake_children, tmp_path):
    fake_children(good_payload(script))
    model = script.write_model(tmp_path)
    assert script.parent(tmp_path, model, 60, "mtp") == 0
    result = json.loads((tmp_path / "spec_decode_pp.json").read_text())
    # nvidia_smi_compute_apps: only when the parent saw the child's file before the child ended.
    assert [k for k in result if k != "nvidia_smi_compute_apps"] == [
        "mode", "engine_kwargs", "timed_out", "child_rc", "wall_s", "child", "memory", "plugin_lines", "errors",
        "checks", "ok"]
    assert result["checks"] == script.checks(good_run(script)) and not (tmp_path / "drafter-eagle3").exists()


def test_parent_fails_when_stock_boots(script, fake_children, tmp_path):
    payload = good_payload(script)
    payload["stock-eagle3"].update(log=[], result={"booted": True, "outputs": [[1]]})
    fake_children(payload)
    assert script.parent(tmp_path, script.write_model(tmp_path), 60, "eagle3") == 1
    result = json.loads((tmp_path / "spec_decode_pp.json").read_text())
    assert result["eagle3"]["ok"] and not result["stock_eagle3"]["ok"]
    assert result["method"] == "eagle3" and "child" not in result  # no MTP arm


def test_arm_time_limit_kills_the_process_group(script, fake_children, tmp_path, monkeypatch):
    payload = good_payload(script)
    payload["stock-eagle3"]["hang"] = True
    fake_children(payload)
    result = script.run_arm(tmp_path, script.write_model(tmp_path), "stock-eagle3", 3)
    assert result["timed_out"] and not result["ok"] and result["time_limit_s"] == 3
    assert process_gone(int((tmp_path / "grandchild.pid").read_text()))


def test_later_arms_keep_their_minimum(script, monkeypatch, tmp_path, no_process_hooks):
    limits = {}

    def run_arm(out, model, arm, timeout):
        limits[arm] = timeout
        return {"ok": True, "wall_s": 1.0, "timed_out": False, "checks": {}, "memory": {
            "end_process_gib": {}, "peak_device_used_gib": []}}

    monkeypatch.setattr(script, "run_arm", run_arm)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    assert script.parent(tmp_path, tmp_path, 240, "both") == 0
    assert limits["mtp"] == pytest.approx(240 - 75 - 45, abs=1)
    assert limits["eagle3"] == pytest.approx(240 - 45, abs=1)
    assert limits["stock-eagle3"] == pytest.approx(240, abs=1)
