"""Patches of ``vllm.v1.core.single_type_kv_cache_manager``: the speculative-decoding drop rule
for Mamba/GDN prefix-cache hits.

With EAGLE/MTP/DFlash the KV cache coordinator asks every drafter-flagged group to drop its last
matched block (``drop_eagle_block=True``); when no group is marked as the drafter's, vLLM 0.30
flags every group, Mamba/GDN groups included (kv_cache_coordinator.py, "Conservatively fall back
to flag all groups"). ``MambaManager.find_longest_cache_hit`` accepts the flag and never reads
it, so a hit can restore the recurrent state of the last matched block, a state that may have
been written over draft tokens that verification rejected (vLLM issue #43559; PR #48375 makes
the Mamba finder honour the flag). The patch lowers the search ceiling by one drop unit when
the flag is set (one hash unit for fine-grained partial hits, else one Mamba block), the rule
of PR #48375, and otherwise calls vLLM's finder unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_dualgpu.patches.spec_common import dualgpu_active


def mamba_drop_unit(kv_cache_spec, alignment_tokens: int) -> int:
    """Tokens the drop removes: the unit vLLM's finder searches in.

    The finder walks hash units when fine-grained partial hits are on (``alignment_tokens``
    divides the Mamba block), else whole Mamba blocks.
    """
    block_size = kv_cache_spec.block_size
    if alignment_tokens < block_size and block_size % alignment_tokens == 0:
        return alignment_tokens
    return block_size


def wrap_mamba_find_longest_cache_hit(original: Callable) -> Callable:
    @functools.wraps(original)
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length,
        kv_cache_group_ids,
        block_pool,
        kv_cache_spec,
        drop_eagle_block,
        alignment_tokens,
        dcp_world_size=1,
        pcp_world_size=1,
    ):
        if drop_eagle_block and max_length > 0 and dualgpu_active():
            max_length = max(0, max_length - mamba_drop_unit(kv_cache_spec, alignment_tokens))
        return original(
            cls,
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            drop_eagle_block,
            alignment_tokens,
            dcp_world_size,
            pcp_world_size,
        )

    return find_longest_cache_hit
