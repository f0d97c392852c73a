"""Speculative decoding under PP (issue #6): each patch on real vLLM objects, stock vs patched.

Every test shows the stock behaviour (vLLM's original, reached through ``__wrapped__`` or by
reverting the patch) and the patched one, so each fails without its patch.
"""


from __future__ import annotations

import os
import functools
import pickle
import shutil
import sys
import types
import pytest
import torch
from torch import nn
from conftest import apply_registry_patch, registry_patch
from vllm_dualgpu.patching.registry import for_version
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from vllm_dualgpu import process
from pathlib import Path


from conftest import FIXTURES


@pytest.fixture(scope="module")
def applied(vllm_version):
    """Apply one registry patch for the module; give vLLM back its original afterwards."""
    done: list[Patch] = []

    def _apply(name: str) -> Patch:
        patch = for_version(name, vllm_version)  # the entry for this vLLM (names may differ)
        if patch is None:
            pytest.skip(f"{name} is not needed on vLLM {vllm_version}")
        done.append(apply_registry_patch(patch.name, vllm_version))
        return done[-1]

    yield _apply
    for patch in done:
        revert_patch(patch)


@pytest.fixture
def active(monkeypatch):
    monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})


@pytest.fixture(scope="module")
def pp_configs(vllm_version, tmp_path_factory):
    """Real VllmConfigs of a tiny Qwen3 with PP=2 (dualgpu and mp) and PP=1 (dualgpu)."""
    from vllm_dualgpu.patches.arg_utils import wrap_create_engine_config
    from vllm.engine.arg_utils import EngineArgs

    d = tmp_path_factory.mktemp("tiny-qwen3")
    shutil.copy(FIXTURES / "tiny_qwen3.json", d / "config.json")
    create = getattr(EngineArgs.create_engine_config, "__wrapped__", None)
    create = wrap_create_engine_config(create or EngineArgs.create_engine_config)

    def make(backend, pp):
        args = EngineArgs(
            model=str(d),
            load_format="dummy",
            skip_tokenizer_init=True,
            pipeline_parallel_size=pp,
            distributed_executor_backend=backend,
        )
        cfg = create(args)
        # vLLM's CPU platform turns async scheduling off; on GPUs it is on by default for
        # an executor that supports it (MultiprocExecutor and its dualgpu subclass do).
        cfg.scheduler_config.async_scheduling = True
        return cfg

    return {"dualgpu": make("dualgpu", 2), "mp": make("mp", 2), "dualgpu-pp1": make("dualgpu", 1)}


def mamba_spec(block_size: int):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block_size,
        shapes=((2, 4), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
    )


@pytest.fixture
def pp_group(pp_stage):
    """A two-stage PP group seen from the last rank (the drafter lives there)."""
    return pp_stage(1, 2)


@pytest.fixture
def kv_layout(pp_configs):
    for cfg in pp_configs.values():
        cfg.cache_config.kv_cache_layout = "LBNHC"  # resolved by EngineCore from the backends
    return pp_configs
