"""The bad-input matrix: each wrong setting gives one clear error or warning, and nothing hangs.

Checks that happen before any GPU is touched run here on real vLLM objects (CPU platform).
Three cases run `vllm serve` end to end and check the process exits and leaves nothing behind.
The planner's own errors (context or weights that cannot fit) are in tests/test_planner_*.py;
the post-profiling fit check is in tests/integration/engine/test_context_fit.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from gpu_harness import group_alive, stop_group
from vllm_dualgpu import envs
from vllm_dualgpu.engine import planning as apply
from vllm_dualgpu.engine import preflight
from vllm_dualgpu.engine.executor import planning_applies
from vllm_dualgpu.nvml import VisibleGpu, visible_physical_ids

GiB = 1024**3


@pytest.fixture(scope="module")
def engine_args_cls():
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    import vllm_dualgpu

    vllm_dualgpu.register()
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


@pytest.fixture
def config_of(engine_args_cls, tiny_model_dir, monkeypatch):
    """create_engine_config through the plugin, with NVML reporting `gpus` visible GPUs."""

    def make(gpus: int | None = 2, **kw):
        monkeypatch.setattr(preflight, "nvml_gpu_count", lambda: gpus)
        args = dict(model=str(tiny_model_dir), load_format="dummy", skip_tokenizer_init=True,
                    pipeline_parallel_size=2, distributed_executor_backend="dualgpu")
        args.update(kw)
        return engine_args_cls(**args).create_engine_config()

    return make


def gpu(pid, name="NVIDIA GeForce RTX 4070 Ti SUPER", total=16, free=15):
    return VisibleGpu(pid, name, total * GiB, free * GiB, (8, 9), 672.0, f"GPU-{pid}")


# --- front end (preflight), real EngineArgs -----------------------------------------------------


def test_01_misspelled_backend(config_of, monkeypatch):
    """vLLM refuses the name itself; the plugin's one line names what was probably meant."""
    from vllm_dualgpu import log

    lines = []
    monkeypatch.setattr(log.logger, "error", lambda fmt, *a: lines.append(fmt % a))
    with pytest.raises(NotImplementedError):
        config_of(distributed_executor_backend="dualgpus")
    assert len(lines) == 1 and "did you mean 'dualgpu'?" in lines[0]


def test_02_pp_larger_than_gpu_count(config_of):
    with pytest.raises(preflight.PreflightError, match="needs 3 GPUs, but 2 are visible"):
        config_of(gpus=2, pipeline_parallel_size=3)


def test_03_single_gpu(config_of):
    with pytest.raises(preflight.PreflightError, match="needs 2 GPUs, but 1 is visible"):
        config_of(gpus=1)


def test_04_malformed_reserve(config_of, monkeypatch):
    monkeypatch.setenv(envs.RESERVE, "1.5XB")
    with pytest.raises(ValueError, match="VLLM_DUALGPU_RESERVE: cannot read '1.5XB'"):
        config_of()


def test_05_reserve_for_wrong_number_of_gpus(config_of, monkeypatch):
    monkeypatch.setenv(envs.RESERVE, "0,1GiB,2GiB")
    with pytest.raises(ValueError, match="names 3 reserves for 2 visible GPUs"):
        config_of()


def test_06_malformed_partition(config_of, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1;3")
    with pytest.raises(ValueError, match="not a comma-separated list"):
        config_of()


def test_07_partition_not_summing_to_layers(config_of, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    with pytest.raises(ValueError, match="summing to the model's 4 layers"):
        config_of()


def test_08_partition_with_empty_stage(config_of, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,0")
    with pytest.raises(ValueError, match="positive layer counts"):
        config_of()


def test_09_conflicting_kv_overrides_warn(config_of, caplog):
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    config_of(kv_cache_memory_bytes=GiB, num_gpu_blocks_override=100)
    assert any("both set: vLLM sizes the pool from --num-gpu-blocks-override" in r.getMessage() for r in caplog.records)


def test_10_kv_bytes_with_reserve_warns(config_of, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setenv(envs.RESERVE, "1GiB")
    config_of(kv_cache_memory_bytes=GiB)
    assert any("no longer shapes the KV pool" in r.getMessage() for r in caplog.records)


def test_11_eagle3_drafter_on_a_model_that_cannot_relay(config_of, monkeypatch):
    cfg = config_of()
    cfg.model_config.hf_text_config.model_type = "qwen3_5"
    cfg.speculative_config = SimpleNamespace(method="eagle3")
    monkeypatch.setattr(preflight, "aux_relay_problem", lambda architectures=(): "patch x is not in the registry")
    with pytest.raises(preflight.PreflightError, match="method 'eagle3' needs auxiliary hidden states.*'qwen3_5'"):
        preflight.check(cfg, 2)


def test_12_model_without_pp_support(engine_args_cls, write_config, monkeypatch):
    monkeypatch.setattr(preflight, "nvml_gpu_count", lambda: 2)
    d = write_config({"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64,
                      "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
                      "vocab_size": 1000, "max_position_embeddings": 512}, "bert")
    with pytest.raises(Exception, match="Pipeline parallelism is not supported for this model"):
        engine_args_cls(model=str(d), load_format="dummy", skip_tokenizer_init=True,
                        pipeline_parallel_size=2, distributed_executor_backend="dualgpu").create_engine_config()


# --- executor (EngineCore), before workers spawn ---------------------------------------------------


def test_13_pp1_behaves_like_stock():
    pc = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1, nnodes=1)
    assert planning_applies(pc) == "pipeline_parallel_size=1"


def test_14_tensor_parallel_alone_is_stock_and_with_pp_is_planned():
    pc = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2, data_parallel_size=1, nnodes=1)
    assert planning_applies(pc) == "pipeline_parallel_size=1"
    pc.pipeline_parallel_size = 2  # TP groups as pipeline stages (tests/integration/engine/test_tp_stages_applied.py)
    assert planning_applies(pc) is None


def test_15_three_gpus_for_pp2_warns_and_uses_two(caplog):
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    used = apply.choose_gpus([gpu(0), gpu(1), gpu(2)], 2)
    assert [g.physical_id for g in used] == [0, 1]
    assert any("3 GPUs visible" in r.getMessage() and "CUDA_VISIBLE_DEVICES" in r.getMessage() for r in caplog.records)


def test_16_executor_gpu_count_check():
    with pytest.raises(ValueError, match="needs 2 GPUs, but only 1 is visible"):
        apply.choose_gpus([gpu(0)], 2)


def test_17_uuid_in_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,1")
    with pytest.raises(ValueError, match="needs integer GPU indexes"):
        visible_physical_ids(2)


def test_18_cuda_visible_devices_out_of_range(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,5")
    with pytest.raises(ValueError, match="names GPU 5, but NVML sees 2"):
        visible_physical_ids(2)


def test_19_no_nvml_is_a_clear_error(monkeypatch):
    def broken():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(apply, "read_visible_gpus", broken)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    with pytest.raises(RuntimeError, match="cannot read the GPUs through NVML.*needs NVIDIA GPUs"):
        apply.apply_plan(cfg)


def test_20_unsupported_vllm_version_patches_nothing(monkeypatch, caplog):
    from vllm_dualgpu import plugin

    plugin._reset_for_tests()
    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.29.0")
    try:
        outcomes = plugin.ensure(frozenset({"engine"}))
    finally:
        plugin._reset_for_tests()
    assert outcomes == []  # the guard is for the front end only
    assert any("found 0.29.0" in r.getMessage() and "stays off" in r.getMessage()
               for r in caplog.records)


def test_21_worker_with_no_room_left(monkeypatch):
    """The worker refuses to start when its GPU's free memory at start is below its reserve:
    DualGpuWorker.init_device with the plan's record (2 GiB reserve) on a card with 1 GiB free
    (vLLM's own device start replaced by its snapshot)."""
    import torch
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dualgpu.engine import handoff, ray_planning
    from vllm_dualgpu.engine import worker as w

    def vllm_init_device(self):
        self.init_snapshot = SimpleNamespace(free_memory=GiB, total_memory=16 * GiB)

    monkeypatch.setattr(Worker, "init_device", vllm_init_device)
    monkeypatch.setattr(w, "refuse_external_weights", lambda *a: None)
    monkeypatch.setattr(ray_planning, "prepare_worker", lambda worker: None)
    monkeypatch.setattr(w.plugin, "ensure_for_dualgpu", lambda kinds: [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA GeForce RTX 4070 Ti SUPER")
    config = SimpleNamespace(additional_config={})
    handoff.store(config, handoff.Handoff(
        ranks=(handoff.RankRecord(0, 0, "NVIDIA H200", GiB, None, 2, None),
               handoff.RankRecord(1, 1, "NVIDIA GeForce RTX 4070 Ti SUPER", 2 * GiB, None, 2, None)),
        partition=(2, 2), partition_source="plan"))
    worker = object.__new__(w.DualGpuWorker)
    worker.rank, worker.device, worker.vllm_config = 1, SimpleNamespace(index=1), config
    worker.load_config, worker.cache_config = None, SimpleNamespace(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"rank 1 \(NVIDIA GeForce RTX 4070 Ti SUPER\): 1.00 GiB free of "
                       r"16.00 GiB at start, reserve 2.00 GiB: nothing left for vLLM"):
        worker.init_device()


# --- end to end: `vllm serve` exits with the message and leaves nothing running ------------------


def serve(tiny_model_dir, extra_env=None, backend="dualgpu", timeout=180):
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(tiny_model_dir),
           "--pipeline-parallel-size", "2", "--distributed-executor-backend", backend,
           "--load-format", "dummy", "--skip-tokenizer-init", "--port", "18123"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **(extra_env or {})}
    start = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        leftover = _group_alive(p.pid)
        if leftover:
            stop_group(p.pid, grace=0)
    return p.returncode, out, time.time() - start, leftover


def _group_alive(pgid: int, wait: float = 15.0) -> bool:
    """Whether any non-zombie process of the group still runs after `wait` seconds."""
    end = time.time() + wait
    while group_alive(pgid) and time.time() < end:
        time.sleep(0.5)
    return group_alive(pgid)


@pytest.mark.slow
@pytest.mark.parametrize("case,env,backend,message", [
    ("typo", {}, "dualgpus", "did you mean 'dualgpu'?"),
    ("reserve", {envs.RESERVE: "lots"}, "dualgpu", "VLLM_DUALGPU_RESERVE: cannot read 'lots'"),
    ("no-gpu", {}, "dualgpu", "the dualgpu executor needs NVIDIA GPUs"),
])
def test_22_serve_exits_cleanly(tiny_model_dir, case, env, backend, message):
    rc, out, took, leftover = serve(tiny_model_dir, env, backend)
    assert rc != 0, out[-2000:]
    assert message in out, out[-3000:]
    assert not leftover, f"processes of the {case} run were still alive after it exited"


# test_23 (a rank out of memory in warm-up ends itself) is
# tests/integration/engine/test_worker_warmup_exit.py, with the CUDA queries failing as after a fault.
