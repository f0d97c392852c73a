"""Prefix-cache hits of a hybrid GDN model with MTP, through a realistic align-mode flow (issue #6).

Real vLLM 0.30 scheduler-side objects on CPU: a ``KVCacheManager`` with a full-attention group and a
GDN ``MambaSpec(mamba_cache_mode="align")`` group, both of block size 144 (the aligned page of a
Qwen3.5-style model), ``use_eagle=True`` as the scheduler passes it for MTP, real ``Request``s with
real block hashes, and the scheduler's own ``_mamba_block_aligned_split`` choosing prefill chunks.

Request A (1,000-token prompt) is prefilled, decodes ten steps with two drafts each (all rejected,
as in the measured run), finishes and is freed. The scheduler ends A's first chunk at 720 tokens
(``last_cache_position`` backed off one block for the EAGLE drop), so the only prompt GDN state
cached is the one after 720 tokens (block 4); attention caches blocks 0-5 (864 tokens).

Lookups, stock vLLM: the resend B hits 720 (attention matches 864, drops one block to 720; the GDN
state at 720 matches). C shares A's first 700 tokens: attention 576 -> 432, no GDN state at 432, so
0 hits and a junction at 432, which C's prefill then caches; D (another sibling) hits 432.

An earlier patch of this package (``mamba-hit-drop-last-block``, after vLLM PR #48375) made the GDN
finder search one block below that already-dropped candidate (576 for B, 288 for D), where align
mode keeps no state: every hit was 0, the 0% hit rate measured on two H200s under PP=2. vLLM 0.30
needs no such drop: the coordinator gives Mamba groups no EAGLE margin, and the states it caches
cover verified tokens only (docs/spec-decoding.md, item 6). The patch was removed; these tests
keep the stock hits, with and without the dualgpu executor active.
"""

from __future__ import annotations

import os

import types

import pytest
import torch

from vllm_dualgpu.patching.registry import PATCHES
from vllm_dualgpu import process

BS = 144  # attention page == GDN state block (vLLM's hybrid block-size alignment)
NUM_SPEC = 2  # MTP num_speculative_tokens
PROMPT = [(i * 7919) % 30000 + 1 for i in range(1000)]


def make_manager():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    attn = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    gdn = MambaSpec(
        block_size=BS,
        shapes=((2, 4), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
        num_speculative_blocks=NUM_SPEC,
    )
    config = KVCacheConfig(
        num_blocks=200,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.3.self_attn.attn", "mtp.self_attn.attn"], attn),
            KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in (0, 1, 2)], gdn),
        ],
    )
    # As Scheduler.__init__ builds it for MTP with one module: use_eagle=use_eagle_block_drop,
    # num_prefill_lookahead=1; hash block = scheduler block = 144 (GCD/LCM of the groups).
    return KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS, use_eagle=True, num_prefill_lookahead=1
    )


def aligned_split():
    """The scheduler's own align-mode chunk split, bound to the attributes it reads."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=BS),
        block_size=BS,  # vLLM 0.33 reads the scheduler's own block size too
        num_hash_lookahead_tokens=0,  # and its lookahead hashes (none without a setting)
        mamba_shared_prefix_checkpoint=False,  # (0.33: only with partial cache hits, off here)
        use_eagle_block_drop=True,
        hash_block_size=BS,
        mamba_has_prefill_checkpoint_blocks=False,  # GDN has no prefill checkpoint blocks
        mamba_prefill_checkpoint_alignment=None,
        max_num_scheduled_tokens=8192,
        scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
        mamba_partial_cache_hit=False,
        mamba_fine_grained_prefix_cache=False,
    )
    return lambda req, n, hit: Scheduler._mamba_block_aligned_split(sched, req, n, hit)


def serve(mgr, rid, prompt, decode_steps=0):
    """Schedule a request like the scheduler does; return (hit tokens, junction, prefill chunk ends)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    req = Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=get_request_block_hasher(BS, sha256))
    split = aligned_split()
    mgr.new_step_starts()
    blocks, hit, req.shared_prefix_boundary = mgr.get_computed_blocks(req)
    chunk_ends, new_hit, new_blocks = [], hit, blocks
    while req.num_computed_tokens < req.num_prompt_tokens:
        n = split(req, req.num_tokens - req.num_computed_tokens - new_hit, new_hit)
        assert mgr.allocate_slots(req, n, new_hit, new_blocks, num_lookahead_tokens=NUM_SPEC) is not None
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens += new_hit + n
        chunk_ends.append(req.num_computed_tokens)
        new_hit, new_blocks = 0, None
        mgr.new_step_starts()
    req.append_output_token_ids(7)
    for step in range(decode_steps):  # verify the sampled token + 2 drafts; both drafts rejected
        req.spec_token_ids = [8, 9]
        assert mgr.allocate_slots(req, 1 + NUM_SPEC, num_lookahead_tokens=NUM_SPEC) is not None
        req.num_computed_tokens += 1 + NUM_SPEC  # scheduled
        req.num_computed_tokens -= NUM_SPEC  # update_from_output: rejected drafts roll back
        req.spec_token_ids = []
        req.append_output_token_ids(10 + step)
        mgr.new_step_starts()
    mgr.free(req)
    return hit, req.shared_prefix_boundary, chunk_ends


def cached_blocks(mgr, group_id):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    import vllm.v1.core.kv_cache_utils as kvu

    init_none_hash(sha256)
    parent, found = kvu.NONE_HASH, []
    for i in range(len(PROMPT) // BS):
        parent = hash_block_tokens(sha256, parent, PROMPT[i * BS : (i + 1) * BS])
        if mgr.block_pool.get_cached_block(parent, [group_id]):
            found.append(i)
    return found


def flow():
    mgr = make_manager()
    _, _, a_chunks = serve(mgr, "A", PROMPT, decode_steps=10)
    state = {"a_chunks": a_chunks, "attn": cached_blocks(mgr, 0), "gdn": cached_blocks(mgr, 1)}
    state["B"] = serve(mgr, "B", list(PROMPT))[:2]
    state["C"] = serve(mgr, "C", PROMPT[:700] + [5] * 300)[:2]
    state["D"] = serve(mgr, "D", PROMPT[:700] + [6] * 300)[:2]
    return state


@pytest.fixture(params=[False, True], ids=["stock", "dualgpu-active"])
def stock(request, monkeypatch):
    """vLLM's own lookup; under the dualgpu executor no registry patch touches it."""
    if request.param:
        monkeypatch.setattr(process, "_worker_run", {"pid": os.getpid(), "run": True})
    else:
        monkeypatch.setattr(process, "_worker_run", {"pid": None, "run": False})
    yield


def test_no_patch_targets_the_prefix_cache_lookup():
    targets = {p.target.split(":")[0] for p in PATCHES}
    assert "vllm.v1.core.single_type_kv_cache_manager" not in targets
    assert "vllm.v1.core.kv_cache_coordinator" not in targets


def test_stock_vllm_hits_the_cache(stock):
    s = flow()
    assert s["a_chunks"] == [720, 1000]  # the align split stops at the EAGLE-dropped boundary
    assert s["attn"] == [0, 1, 2, 3, 4, 5]
    assert s["gdn"] == [4]  # the only prompt GDN state: after 720 tokens
    assert s["B"] == (720, 0)  # resend: attention 864 - 144 = 720, GDN state at 720
    assert s["C"] == (0, 432)  # sibling: attention 576 - 144 = 432, no GDN state there yet
    assert s["D"] == (432, 0)  # C cached the junction state; the next sibling hits it
