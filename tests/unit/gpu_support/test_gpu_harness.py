"""The CPU part of gpu_harness: a process group is ended whole (a grandchild that ignores SIGTERM
included), and a job in a fresh process returns its result, its error or its time-out."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

from gpu_harness import group_alive, run_llm, start_group, stop_group

STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); print('up', flush=True); time.sleep(600)")


def running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_group_ends_a_group_that_ignores_sigterm(tmp_path):
    log = tmp_path / "stubborn.log"
    p = start_group([sys.executable, "-c", STUBBORN], log)
    end = time.time() + 30
    while "up" not in log.read_text() and time.time() < end:
        time.sleep(0.1)
    members = [d for d in os.listdir("/proc") if d.isdigit() and running(int(d)) and os.getpgid(int(d)) == p.pid]
    assert len(members) == 2 and group_alive(p.pid)
    t0 = time.time()
    stop_group(p.pid, grace=0.5)
    assert not group_alive(p.pid), "a member of the group survived"
    assert time.time() - t0 < 10
    assert os.getpgid(os.getpid()) != p.pid  # the test's own group was not touched


def answer(_llm) -> dict:
    return {"pid": os.getpid(), "target_device": os.environ.get("VLLM_TARGET_DEVICE"), "leader": os.getpgid(0) == os.getpid()}


def fail(_llm) -> dict:
    raise RuntimeError("the job failed")


def hang(_llm, pidfile: str) -> dict:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile, "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
    return {}


def test_a_job_runs_in_a_fresh_process_leading_its_group(tmp_path):
    res = run_llm(None, answer, log=tmp_path / "answer.log", timeout=60)
    assert not res["timed_out"] and "error" not in res, res
    assert res["pid"] != os.getpid() and res["leader"]
    assert res["target_device"] is None  # the CPU tests' VLLM_TARGET_DEVICE=cpu does not reach GPU children
    assert not group_alive(res["pid"])


def test_a_failing_job_reports_its_error(tmp_path):
    res = run_llm(None, fail, log=tmp_path / "fail.log", timeout=60)
    assert res["error"] == "RuntimeError: the job failed" and not res["timed_out"]
    assert "Traceback" in (tmp_path / "fail.log").read_text()


def test_a_hanging_job_is_timed_out_and_its_group_ended(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.time()
    res = run_llm(None, functools.partial(hang, pidfile=str(pidfile)), log=tmp_path / "hang.log", timeout=8)
    assert res["timed_out"] and res["error"] == "no result"
    assert time.time() - t0 < 30
    assert not running(int(pidfile.read_text())), "the job's own child outlived the time-out"


# a grandchild that moves to a process group of its own, as a process of vLLM may
WANDERER = ("import os, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(600)']); "
            "time.sleep(0.5); print('up', c.pid, flush=True); time.sleep(600)")


def test_stop_group_ends_what_left_the_group_but_not_the_session(tmp_path):
    """The GPU run of 2026-12-01 found 43 GiB still held after an interrupted test: what a run
    starts stays in its session (start_group and run_llm's child start one), not always in its
    process group."""
    log = tmp_path / "wanderer.log"
    p = start_group([sys.executable, "-c", WANDERER], log)
    end = time.time() + 30
    while "up" not in log.read_text() and time.time() < end:
        time.sleep(0.1)
    child = int(log.read_text().split()[1])
    assert running(child) and os.getpgid(child) != p.pid
    stop_group(p.pid, grace=0.5)
    time.sleep(0.3)
    assert not running(child), "the process that left the group survived"
    assert not group_alive(p.pid)


def _job_env(_llm):
    return {k: os.environ.get(k) for k in ("VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "VLLM_DISABLED_KERNELS")}


def test_children_take_precompiled_kernels_unless_asked(tmp_path, monkeypatch):
    """Every child the harness starts avoids the kernels vLLM 0.33 builds or warms up on first use
    (FlashInfer's SM90 block-FP8 GEMM and sampler, humming's, DeepGEMM's): on a fresh GPU machine those builds outlasted a whole call
    (seen twice). An explicit value wins; DUALGPU_GPU_JIT_KERNELS=1 leaves vLLM's choice."""
    from gpu_harness import child_env

    monkeypatch.delenv("DUALGPU_GPU_JIT_KERNELS", raising=False)
    env = child_env()
    assert env["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] == "0"
    assert "HummingNvFp4LinearKernel" in env["VLLM_DISABLED_KERNELS"].split(",")
    # DeepGEMM: neither reference card (SM 8.9, 12.0) runs it; its warmup outlasted a call (twelfth session)
    assert env["VLLM_USE_DEEP_GEMM"] == "0"
    # FlashInfer's sampler: its JIT build took 2 minutes of a headline arm's boot (thirteenth session)
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert child_env({"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "1"})["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] == "1"
    res = run_llm(None, _job_env, log=tmp_path / "job.log", timeout=60)
    assert res["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] == "0" and "HummingLinearKernel" in res["VLLM_DISABLED_KERNELS"]
    monkeypatch.setenv("DUALGPU_GPU_JIT_KERNELS", "1")
    monkeypatch.delenv("VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", raising=False)
    assert "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER" not in child_env()
    assert run_llm(None, _job_env, log=tmp_path / "jit.log", timeout=60)["VLLM_DISABLED_KERNELS"] is None


def test_a_server_left_by_an_error_writes_its_stacks_first(tmp_path):
    """A request that hangs (the tenth and twelfth sessions' `vllm serve` PP=2 first completion)
    ends the test with an error or the time limit's interrupt: the server's processes write their
    stacks to its log before they are ended, so the log says where they waited."""
    from gpu_harness import VllmServer

    log = tmp_path / "serve.log"
    server = VllmServer("model", [], log=log)
    server.proc = start_group([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"], log)
    end = time.time() + 30
    while "up" not in log.read_text() and time.time() < end:
        time.sleep(0.1)
    server.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert not group_alive(server.proc.pid)
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text and 'File "<string>", line 1' in text, text


def test_virtual_pair_children_take_triton_attention_unless_chosen(monkeypatch):
    """A rank presenting SM 8.9 on the H200 would run FlashAttention 2, whose sm_80-only kernels the
    driver compiles from PTX on first use (minutes: every first request waited, 2026-12-02)."""
    from gpu_harness import VllmServer, with_virtual_pair_attention

    monkeypatch.delenv("VLLM_DUALGPU_VIRTUAL_GPUS", raising=False)
    monkeypatch.delenv("DUALGPU_GPU_JIT_KERNELS", raising=False)
    pair = {"VLLM_DUALGPU_VIRTUAL_GPUS": "RTX 4070 Ti SUPER:8GiB,NVIDIA H200:12GiB"}
    kw = {"model": "m", "pipeline_parallel_size": 2}
    assert with_virtual_pair_attention(kw, pair)["attention_backend"] == "TRITON_ATTN"
    assert with_virtual_pair_attention(kw, pair)["mm_encoder_attn_backend"] == "TORCH_SDPA"  # FA2 on 8.x too
    own = with_virtual_pair_attention({**kw, "mm_encoder_attn_backend": "FLASHINFER"}, pair)
    assert own["mm_encoder_attn_backend"] == "FLASHINFER"
    assert "attention_backend" not in with_virtual_pair_attention(kw, {})  # a real pair, or stock on one GPU
    assert "attention_backend" not in with_virtual_pair_attention({**kw, "kv_cache_dtype": "fp8"}, pair)
    chosen = {**kw, "attention_backend": "FLASHINFER"}
    assert with_virtual_pair_attention(chosen, pair)["attention_backend"] == "FLASHINFER"
    assert with_virtual_pair_attention(None, pair) is None

    def cmd(args, env):
        return VllmServer("m", args, log=None, env=env).cmd

    assert cmd(["--pipeline-parallel-size", "2"], pair)[-6:-2] == ["--attention-backend", "TRITON_ATTN",
                                                                   "--mm-encoder-attn-backend", "TORCH_SDPA"]
    assert "--attention-backend" not in cmd(["--pipeline-parallel-size", "2"], {})
    assert "--attention-backend" not in cmd(["--kv-cache-dtype", "fp8"], pair)
    assert cmd(["--attention-backend=FLASHINFER"], pair).count("--attention-backend=FLASHINFER") == 1
    assert "TRITON_ATTN" not in cmd(["--attention-backend=FLASHINFER"], pair)
    monkeypatch.setenv("DUALGPU_GPU_JIT_KERNELS", "1")  # vLLM's own choice, FA2 and its compile
    assert "attention_backend" not in with_virtual_pair_attention(kw, pair)
    assert "--attention-backend" not in cmd([], pair)


def test_patches_in_force_names_each_releases_entry():
    """The GPU tests check a patch family by the entry in force for the installed vLLM: the
    twenty-third session's vision and packed-embedding runs passed their claims on vLLM 0.33 and
    failed on the bare names (0.33 runs qwen3-next-embed-quant-config-032, and builds the vision
    tower on the first rank itself)."""
    from gpu_harness import patches_in_force

    family = ("qwen3-next-embed-quant-config",)
    assert patches_in_force(family, "0.30.0") == ["qwen3-next-embed-quant-config"]
    assert patches_in_force(family, "0.33.0") == ["qwen3-next-embed-quant-config-032"]
    assert patches_in_force(("vision-tower-first-rank-only",), "0.32.0") == ["vision-tower-first-rank-only"]
    assert patches_in_force(("vision-tower-first-rank-only",), "0.33.0") == []
    assert patches_in_force(("kv-groups-know-ranks", "pp-inflight-batches"), "0.33.0") == \
        ["kv-groups-know-ranks-033", "pp-inflight-batches"]
