"""The GPU harness's torch top-k switch (DUALGPU_GPU_TORCH_TOPK=1, tests/gpu/torch_topk_site/): a
child process's vLLM takes torch.topk for its vocab-parallel top-k, and says so on stderr; without
the switch vLLM's own function stays. Through a real child process and vLLM's real module."""

from __future__ import annotations

import os
import subprocess
import sys

from gpu_harness import TORCH_TOPK_ENV, TORCH_TOPK_LINE, child_env

PROBE = (
    "import torch, vllm.model_executor.layers.logits_processor as lp; "
    "v, i = lp._topk(torch.tensor([[0.5, 3.0, -1.0, 2.0]]), 2); "
    "print('probe:', lp._flashinfer_topk.__name__, i.tolist(), v.tolist())"
)


def answer(r: subprocess.CompletedProcess) -> str:
    """The probe's line (vLLM 0.30 logs to stdout too)."""
    lines = [line for line in r.stdout.splitlines() if line.startswith("probe: ")]
    assert len(lines) == 1, r.stdout
    return lines[0].removeprefix("probe: ")


def probe(switch: str | None) -> subprocess.CompletedProcess:
    extra = {"VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": os.pathsep.join(sys.path[1:])}
    if switch is not None:
        extra[TORCH_TOPK_ENV] = switch
    env = child_env(extra)
    if switch is None:
        env.pop(TORCH_TOPK_ENV, None)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)


def test_switch_on_gives_torch_topk_and_says_so():
    r = probe("1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert answer(r) == "_torch_topk_instead [[1, 3]] [[3.0, 2.0]]"
    lines = [line for line in r.stderr.splitlines() if line.startswith(TORCH_TOPK_LINE)]
    assert len(lines) == 1, r.stderr[-2000:]


def test_switch_off_keeps_vllms_function():
    for switch in (None, "0"):
        r = probe(switch)
        assert r.returncode == 0, r.stderr[-2000:]
        assert answer(r).split()[0] == "_flashinfer_topk"
        assert TORCH_TOPK_LINE not in r.stderr


def _forked_answer(q) -> None:
    import vllm.model_executor.layers.logits_processor as lp

    q.put(lp._flashinfer_topk.__name__)


def fork_and_probe(_llm) -> dict:
    """run_llm's job: what a forked child (stock vLLM's EngineCore without spawned workers) gets."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_answer, args=(q,))
    p.start()
    p.join(120)
    return {"forked": q.get(timeout=5)}


def test_switch_on_reaches_a_process_that_run_llm_forks(tmp_path, monkeypatch):
    """2026-12-04: the DFlash test's stock half (PP=1, vLLM forks its EngineCore from run_llm's
    child) built FlashInfer's top-k with the switch on: run_llm's child set PYTHONPATH after its own
    start, so nothing it forked had the hook."""
    from gpu_harness import run_llm

    monkeypatch.setenv(TORCH_TOPK_ENV, "1")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    res = run_llm(None, fork_and_probe, log=tmp_path / "probe.log", timeout=240)
    assert "error" not in res and not res["timed_out"], (res, (tmp_path / "probe.log").read_text()[-2000:])
    assert res["forked"] == "_torch_topk_instead", res
