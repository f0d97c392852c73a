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
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from vllm_dualgpu import process
from pathlib import Path
from spec_pp import active, applied, pp_group  # noqa: F401  (shared fixtures and helpers)


class FakeDraft(nn.Module):
    """Stands in for an MTP drafter: ``.model.embed_tokens``, no has_own_embed_tokens."""

    def __init__(self, vocab=32, hidden=8):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)


def test_drafter_shares_target_embedding_under_pp(applied, active, pp_group):
    from vllm.v1.worker.gpu.spec_decode.dflash import utils as dflash_utils
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    patch = applied("drafter-shares-target-embed")
    share = eagle_utils.maybe_share_target_embed
    assert getattr(share, SENTINEL) == patch.name
    assert dflash_utils.maybe_share_target_embed is share  # the from-import copy is rebound

    target_inner = nn.Module()
    target_inner.embed_tokens = nn.Embedding(32, 8)

    stock_draft = FakeDraft()
    own = stock_draft.model.embed_tokens
    share.__wrapped__(stock_draft, stock_draft.model, target_inner)
    assert stock_draft.model.embed_tokens is own  # vLLM 0.30 keeps the drafter's own copy

    draft = FakeDraft()
    share(draft, draft.model, target_inner)
    assert draft.model.embed_tokens is target_inner.embed_tokens
    params = {id(p) for p in draft.parameters()} | {id(p) for p in target_inner.parameters()}
    assert len(params) == 1  # one embedding weight left for target and drafter


def test_drafter_keeps_its_embedding_when_the_stage_has_none(applied, active, pp_group):
    from vllm.model_executor.models.utils import PPMissingLayer
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    applied("drafter-shares-target-embed")
    target_inner = nn.Module()
    target_inner.embed_tokens = PPMissingLayer()
    draft = FakeDraft()
    own = draft.model.embed_tokens
    eagle_utils.maybe_share_target_embed(draft, draft.model, target_inner)  # no RuntimeError
    assert draft.model.embed_tokens is own


def test_drafter_embedding_stock_without_dualgpu_or_with_own_flag(applied, pp_group, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    applied("drafter-shares-target-embed")
    target_inner = nn.Module()
    target_inner.embed_tokens = nn.Embedding(32, 8)
    monkeypatch.setattr(process, "_worker_run", {"pid": None, "run": False})
    draft = FakeDraft()
    own = draft.model.embed_tokens
    eagle_utils.maybe_share_target_embed(draft, draft.model, target_inner)
    assert draft.model.embed_tokens is own
    # A drafter that trained its own embedding keeps it under dualgpu too (vLLM's rule).
    monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})
    trained = FakeDraft()
    trained.has_own_embed_tokens = True
    own = trained.model.embed_tokens
    eagle_utils.maybe_share_target_embed(trained, trained.model, target_inner)
    assert trained.model.embed_tokens is own


def test_drafter_with_own_table_beside_a_quantized_target(applied, active, pp_group, monkeypatch):
    """A packed target embedding has no .weight: vLLM's comparison raises, the patch keeps the
    drafter's own table (qwen3-next-embed-quant-config makes Qwen3.5 embeddings packed)."""
    from vllm.v1.worker.gpu.spec_decode.eagle import utils as eagle_utils

    applied("drafter-shares-target-embed")
    target_inner = nn.Module()
    target_inner.embed_tokens = nn.Module()
    target_inner.embed_tokens.weight_packed = nn.Parameter(torch.zeros(32, 2, dtype=torch.int32),
                                                           requires_grad=False)
    drafter = FakeDraft()
    drafter.has_own_embed_tokens = True
    own = drafter.model.embed_tokens
    if _stock_compares_packed(eagle_utils):
        with pytest.raises(AttributeError, match="weight"):
            eagle_utils.maybe_share_target_embed.__wrapped__(drafter, drafter.model, target_inner)
    eagle_utils.maybe_share_target_embed(drafter, drafter.model, target_inner)
    assert drafter.model.embed_tokens is own
    monkeypatch.setattr(process, "_worker_run", {"pid": None, "run": False})  # other executors: vLLM's behaviour
    if _stock_compares_packed(eagle_utils):
        with pytest.raises(AttributeError, match="weight"):
            eagle_utils.maybe_share_target_embed(drafter, drafter.model, target_inner)
    else:  # vLLM 0.34 keeps the drafter's own table itself
        eagle_utils.maybe_share_target_embed(drafter, drafter.model, target_inner)
        assert drafter.model.embed_tokens is own


def _stock_compares_packed(eagle_utils) -> bool:
    """Whether vLLM's _should_share reads ``target.weight`` unguarded (0.30-0.33); vLLM 0.34
    keeps the drafter's own table where either copy has no tensor named weight."""
    import inspect

    return "target_w" not in inspect.getsource(eagle_utils._should_share)
