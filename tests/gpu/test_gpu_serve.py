"""``vllm serve`` through the plugin (issues #2, #4): the server becomes healthy, answers
``/v1/completions``, and every process (API server, EngineCore, each worker) logs the plugin's
line. On two GPUs also PP=2, and the same server without the native hook gives the same tokens."""

from __future__ import annotations

import re

import pytest

from gpu_harness import VllmServer, gpu_out, model_dir, needs_gpus, needs_pair, pair_env, plugin_lines  # noqa: F401

PROMPTS = ["the planet", "water is", "one day the sun and the moon", "people call their"]
ARGS = ["--distributed-executor-backend", "dualgpu", "--load-format", "dummy", "--max-model-len", "4096",
        "--enforce-eager"]


def worker_pids(log) -> set[str]:
    return {m.group(1) or m.group(2) for line in plugin_lines(log, "worker")
            for m in [re.search(r"\(worker, pid (\d+)|pid=(\d+)", line)] if m}


def serve_and_complete(model, args, log, record_property, env=None) -> list[str]:
    with VllmServer(str(model), args, log=log, env=env) as server:
        texts = server.complete(PROMPTS, max_tokens=16)
    record_property(f"{log.stem} ready_s", server.ready_s)
    assert len(texts) == len(PROMPTS) and all(texts), f"completions: {texts}"
    assert plugin_lines(log, "frontend"), "the API server logged no plugin line"
    assert plugin_lines(log, "engine"), "EngineCore logged no plugin line"
    return texts


@needs_gpus(1)
@pytest.mark.timeout(420)
def test_serve_on_one_gpu(model_dir, gpu_out, record_property):
    log = gpu_out / "serve-pp1.log"
    serve_and_complete(model_dir("tiny-dense"), ARGS + ["--gpu-memory-utilization", "0.5"], log, record_property)
    assert len(worker_pids(log)) == 1, f"worker plugin lines: {plugin_lines(log, 'worker')}"


@needs_pair()
@pytest.mark.timeout(580)
def test_serve_pp2_and_without_the_hook(model_dir, gpu_out, record_property):
    model = model_dir("tiny-dense")
    log = gpu_out / "serve-pp2.log"
    texts = serve_and_complete(model, ARGS + ["--pipeline-parallel-size", "2"], log, record_property,
                               env=pair_env())
    assert len(worker_pids(log)) == 2, f"worker plugin lines: {plugin_lines(log, 'worker')}"
    off = serve_and_complete(model, ARGS + ["--pipeline-parallel-size", "2"], gpu_out / "serve-pp2-nohook.log",
                             record_property, env={"VLLM_DUALGPU_SM_HOOK": "0", **pair_env()})
    assert off == texts, "the server without the sm hook gave other tokens"
