"""Faults under PP=2 through the plugin (issue #23 part 3), on two GPUs or the virtual pair:
``vllm serve`` with requests streaming when a worker is killed (SIGKILL) or stopped (SIGSTOP),
and a rank that runs out of its card's memory while generating. Each case records its time to a
clear end; the claims are bounds."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest
from gpu_harness import (  # noqa: F401
    VllmServer,
    gpu_out,
    grep,
    group_alive,
    model_dir,
    needs_pair,
    pair_env,
    plugin_lines,
    rank_fault_lines,
    run_llm,
    tail,
)

ARGS = ["--load-format", "dummy", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.3", "--pipeline-parallel-size", "2",
        "--distributed-executor-backend", "dualgpu"]


def stream(server: VllmServer, out: dict, key: int, limit: float, seen: dict | None = None) -> None:
    """One streaming completion; out[key]: how it ended and when; seen[key]: chunks so far."""
    t0 = time.time()
    body = {"model": server.model, "prompt": f"count {key}", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(server.url("/v1/completions"), json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    chunks = 0
    try:
        with urllib.request.urlopen(req, timeout=limit) as r:
            for line in r:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks += 1
                    if seen is not None and b'"error"' not in line:
                        seen[key] = chunks  # tokens, not the error event
                    if b'"error"' in line:
                        out[key] = {"end": "error event", "s": round(time.time() - t0, 1), "chunks": chunks}
                        return
        out[key] = {"end": "finished", "s": round(time.time() - t0, 1), "chunks": chunks}
    except Exception as exc:
        out[key] = {"end": f"{type(exc).__name__}: {str(exc)[:120]}", "s": round(time.time() - t0, 1),
                    "chunks": chunks}


def worker_pids(log) -> list[int]:
    """The two workers' pids, rank order (vLLM prefixes their lines "(Worker_PP<r> pid=N)")."""
    text = log.read_text(errors="replace")
    found = {int(r): int(p) for r, p in re.findall(r"\(Worker_PP(\d) pid=(\d+)\)", text)}
    return [found[r] for r in sorted(found)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


STALL_LIMIT_S = 30
STREAMING_WITHIN_S = 120  # the first tokens of every stream, before the fault


def wait_streaming(seen: dict, n: int, limit: float) -> float | None:
    """Seconds until each of ``n`` streams has had a token chunk; None if not within ``limit``.
    The fault comes mid-stream only then: on the virtual pair the eighteenth session found every
    earlier fault run's streams still waiting for their first token (FlashAttention 2 compiling)."""
    t0 = time.time()
    while time.time() - t0 < limit:
        if len(seen) == n and all(c >= 1 for c in seen.values()):
            return round(time.time() - t0, 1)
        time.sleep(0.2)
    return None


def run_fault(model, gpu_out, sig: int, name: str, record_property, bound: float, env: dict | None = None) -> dict:
    log = gpu_out / f"{name}.log"
    results: dict = {}
    with VllmServer(str(model), ARGS, log=log, env={**pair_env(), **(env or {})}, timeout=400) as server:
        pids = worker_pids(log)
        assert len(pids) == 2, f"worker plugin lines: {plugin_lines(log, 'worker')}"
        seen: dict = {}
        threads = [threading.Thread(target=stream, args=(server, results, i, bound + STREAMING_WITHIN_S + 30, seen),
                                    daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        streaming_s = wait_streaming(seen, 4, STREAMING_WITHIN_S)
        assert streaming_s is not None, f"not every stream had a token within {STREAMING_WITHIN_S} s: {seen}"
        time.sleep(1.0)  # the requests are streaming
        before = dict(seen)
        t_fault = time.time()
        os.kill(pids[-1], sig)
        health_bad_s = None
        while time.time() - t_fault < bound:
            try:
                with urllib.request.urlopen(server.url("/health"), timeout=2) as r:
                    ok = r.status == 200
            except Exception:
                ok = False
            if not ok and health_bad_s is None:
                health_bad_s = round(time.time() - t_fault, 1)
            if health_bad_s is not None and all(not t.is_alive() for t in threads):
                break
            time.sleep(0.5)
        ended = {k: v for k, v in results.items()}
        server_exit = server.proc.poll()
        if sig == signal.SIGSTOP:
            os.kill(pids[-1], signal.SIGCONT)
    # the server's group has been ended by VllmServer's exit
    time.sleep(2.0)
    rec = {"signal": signal.Signals(sig).name, "streaming_after_s": streaming_s, "chunks_before_fault": before,
           "requests": ended, "health_bad_after_s": health_bad_s,
           "server_exit_code_within_bound": server_exit, "group_left": group_alive(server.proc.pid),
           "workers_left": [p for p in pids if alive(p)],
           "ranks_named": rank_fault_lines(log), "log_tail": tail(log, 15)}
    record_property(name, {k: v for k, v in rec.items() if k != "log_tail"})
    (gpu_out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    return rec


@needs_pair()
@pytest.mark.timeout(600)
def test_a_killed_worker_fails_every_request(model_dir, gpu_out, record_property):
    rec = run_fault(model_dir("tiny-dense"), gpu_out, signal.SIGKILL, "sigkill", record_property, bound=60)
    assert len(rec["requests"]) == 4, f"requests still open 60 s after the kill: {rec['requests']}"
    assert all(r["end"] != "finished" or r["chunks"] < 1500 for r in rec["requests"].values()), rec["requests"]
    assert rec["health_bad_after_s"] is not None, "the server still reported healthy 60 s after the kill"
    named = rec["ranks_named"]["dead"]
    assert len(named) == 1 and re.match(r"vllm-dualgpu: pipeline rank 1 \(GPU \d+: .*\) was killed by signal 9 ",
                                        named[0]), f"the killed rank named (only it, while the server ran): {named}"
    assert not rec["group_left"] and not rec["workers_left"], rec


@needs_pair()
@pytest.mark.timeout(600)
def test_a_stopped_worker_is_bounded(model_dir, gpu_out, record_property):
    """SIGSTOP: the worker neither dies nor answers. vLLM waits for a step up to
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s by default; 30 s here), then fails the engine."""
    rec = run_fault(model_dir("tiny-dense"), gpu_out, signal.SIGSTOP, "sigstop", record_property, bound=90,
                    env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STALL_LIMIT_S)})
    record_property("requests ended within 90 s", f"{len(rec['requests'])}/4")
    assert not rec["group_left"] and not rec["workers_left"], rec
    # vLLM's own bound on a step that does not come back (multiproc_executor.py: execute_model's
    # futures wait VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, default 300): seen on the virtual pair,
    # a stopped worker left /health at 200 and every stream silent for 55 s.
    assert rec["health_bad_after_s"] is not None and rec["health_bad_after_s"] < STALL_LIMIT_S + 30, rec
    assert len(rec["requests"]) == 4, f"streams still open {STALL_LIMIT_S + 60} s after the stop: {rec['requests']}"
    named = rec["ranks_named"]["unanswered"]
    assert named and re.match(rf"vllm-dualgpu: no answer to \w+ within {STALL_LIMIT_S} s .*pipeline rank 1 "
                              r"\(GPU \d+: .*\) is stopped \(SIGSTOP", named[0]), f"the stopped rank named: {named}"


OOM_RANK = 0
OOM_BOUND_S = 60


def fill_card(worker, rank: int) -> int:
    """In each worker: on ``rank``, allocate until torch refuses (the card's cap and the
    allocator's cached blocks both used up) and keep it; bytes taken."""
    import torch

    if worker.rank != rank:
        return 0
    held, chunk = [], 256 << 20
    while chunk >= 1 << 20:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device=worker.device))
        except torch.OutOfMemoryError:
            chunk //= 4
    worker._fault_ballast = held
    return sum(t.numel() for t in held)


def fill_then_generate(llm) -> dict:
    import sys

    import cloudpickle
    from vllm import SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    taken = llm.collective_rpc(fill_card, args=(OOM_RANK,), timeout=120)
    t0 = time.time()
    prompts = [{"prompt_token_ids": [5 + (i * 31 + j) % 200 for j in range(1500)]} for i in range(4)]
    try:
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
        return {"taken": taken, "generated": True, "s": round(time.time() - t0, 1)}
    except Exception as exc:
        return {"taken": taken, "generated": False, "raised": f"{type(exc).__name__}: {exc}"[:400],
                "s": round(time.time() - t0, 1)}


@needs_pair()
@pytest.mark.timeout(600)
def test_a_rank_out_of_its_card_while_serving_ends_with_its_name(model_dir, gpu_out, record_property):
    """Rank 0 fills its (virtual) card, then a batch of long prompts needs activations there:
    the rank says it ran out of memory while serving, with its card and the fix, and ends, so
    the engine fails the requests at once instead of waiting for the other rank."""
    log = gpu_out / "oom.log"
    kwargs = {"model": str(model_dir("tiny-dense")), "load_format": "dummy", "enforce_eager": True,
              "max_model_len": 2048, "pipeline_parallel_size": 2, "distributed_executor_backend": "dualgpu"}
    res = run_llm(kwargs, fill_then_generate, log=log, timeout=400, env=pair_env())
    record_property("oom", {k: v for k, v in res.items() if k != "log"})
    assert not res["timed_out"], tail(log)
    assert res.get("taken") and res["taken"][OOM_RANK] > 0, res
    assert res.get("generated") is False and res["s"] < OOM_BOUND_S, res
    line = grep(log, "ran out of memory while serving")
    assert line and f"rank {OOM_RANK} (" in line[0] and "VLLM_DUALGPU_RESERVE" in line[0], tail(log)


REQUIRED_ENGINE_PATCH = "pp-inflight-batches"


def break_then_boot(_llm, kwargs: dict) -> dict:
    """In a fresh process, the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a required
    engine patch whose target signature no longer matches, then vllm.LLM. Returns how it ended."""
    import dataclasses
    import time as _time

    from vllm_dualgpu.patching import registry

    registry.PATCHES = tuple(dataclasses.replace(p, params=("not", "vllms")) if p.name == REQUIRED_ENGINE_PATCH
                             else p for p in registry.PATCHES)
    from vllm import LLM

    t0 = _time.time()
    try:
        LLM(**kwargs)
        return {"booted": True, "s": round(_time.time() - t0, 1)}
    except Exception as exc:
        return {"booted": False, "raised": type(exc).__name__, "message": str(exc)[:600],
                "s": round(_time.time() - t0, 1)}


@needs_pair()
@pytest.mark.timeout(300)
def test_a_required_patch_that_does_not_apply_refuses_before_the_engine_starts(model_dir, gpu_out, record_property):
    import functools

    log = gpu_out / "required-patch.log"
    kwargs = {"model": str(model_dir("tiny-dense")), "load_format": "dummy", "enforce_eager": True,
              "max_model_len": 2048, "pipeline_parallel_size": 2, "distributed_executor_backend": "dualgpu"}
    res = run_llm(None, functools.partial(break_then_boot, kwargs=kwargs), log=log, timeout=240,
                  env={**pair_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    record_property("required patch refused", {k: v for k, v in res.items() if k != "log"})
    assert not res["timed_out"] and res.get("booted") is False, res
    assert f"required patch {REQUIRED_ENGINE_PATCH}" in res["message"] and "--distributed-executor-backend mp" in res["message"]
    assert not grep(log, r"Worker_PP\d|VllmWorker-\d"), "a worker started before the refusal"
