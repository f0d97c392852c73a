"""The rank summary's "pool" is the tokens the KV pool holds as vLLM counts them ("GPU KV cache
size"), also where a request takes blocks in more than one KV cache group (a hybrid model's
attention and state groups, a DFlash drafter's own): not blocks x block size."""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import FIXTURES
from vllm_dualgpu import rank_summary
from vllm_dualgpu.engine import worker as w

GiB = 1024**3


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path_factory.mktemp("tiny")
    shutil.copy(FIXTURES / "tiny_qwen3.json", d / "config.json")
    return EngineArgs(model=str(d), load_format="dummy", skip_tokenizer_init=True, max_model_len=800,
                      pipeline_parallel_size=2, distributed_executor_backend="mp").create_engine_config()


def test_two_groups_hold_half_the_tokens_of_blocks_x_block_size(vllm_config, monkeypatch, caplog):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu_worker import Worker

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    # 100 blocks of 16 tokens; a request of 800 tokens takes 50 blocks in each of the two groups,
    # so the pool holds one such request: 800 tokens (blocks x block size would say 1,600).
    config = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], spec)])
    monkeypatch.setattr(Worker, "initialize_from_config", lambda self, c: None)  # no allocation here
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (GiB, 16 * GiB))
    rank_summary.clear()
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = 1, "cuda:1"
    r.vllm_config = vllm_config
    r.cache_config = SimpleNamespace(num_gpu_blocks=None, block_size=16)
    r.model_config = vllm_config.model_config
    r.model_runner = SimpleNamespace(model_memory_usage=GiB)
    r._pp_position = lambda: (1, 2)
    r._dualgpu_plan = None
    r.initialize_from_config(config)
    caplog.set_level(logging.INFO, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    try:
        r._log_summary()
    finally:
        rank_summary.clear()
    (line,) = [m for m in (x.getMessage() for x in caplog.records) if "vllm-dualgpu rank" in m]
    assert "100 blocks x 16 tokens" in line
    assert "max context: 800 tokens (pool 800)" in line
