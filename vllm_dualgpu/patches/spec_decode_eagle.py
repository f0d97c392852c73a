"""Patches of ``vllm.v1.worker.gpu.spec_decode.eagle.utils``: the drafter shares the target's
input embedding under PP.

The V2 runner builds the drafter on the last PP rank only. ``maybe_share_target_embed`` returns
early whenever PP > 1 and the drafter does not declare ``has_own_embed_tokens``; MTP drafters
(``Qwen3_5MTP`` and others) declare nothing, so under PP the drafter keeps the embedding it
loaded from the checkpoint, a second copy of the target's on the last rank (Qwen3.5 builds
``embed_tokens`` on every rank; 2.4 GiB on a 27B model). Under the dualgpu executor, when the
target's embedding exists on this stage (not a ``PPMissingLayer``), the patched function shares
it exactly as vLLM does without PP; when it does not exist, vLLM's early return is kept, so
the drafter still has an embedding. ``dflash.utils`` imported a copy of the function and is
rebound too; ``dspark.utils`` imports it at call time and sees the patched function.

A drafter that declares ``has_own_embed_tokens`` (EAGLE3, DFlash) is shared only when its table
equals the target's (vLLM's ``_should_share`` compares ``.weight``). A quantized target embedding
(``qwen3-next-embed-quant-config``) has packed weights and no ``.weight``, so vLLM's comparison
would raise ``AttributeError``; under the dualgpu executor such a drafter keeps its own table
(a packed table cannot equal a dense one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_dualgpu.patches.spec_common import is_dualgpu_run


def target_embedding(target_inner):
    """The target's input embedding on this stage, as vLLM's function resolves it, or None."""
    from vllm.lora.layers.base import BaseLayerWithLoRA
    from vllm.model_executor.models.utils import PPMissingLayer

    embed = getattr(target_inner, "embed_tokens", None) or getattr(target_inner, "embedding", None)
    if isinstance(embed, PPMissingLayer):
        return None
    if isinstance(embed, BaseLayerWithLoRA):  # the drafter does not use the target's LoRA
        embed = embed.base_layer
    return embed


def keeps_own_beside_packed_target(draft_model, draft_inner, target_inner) -> bool:
    """A drafter with its own table beside a target embedding without ``.weight`` (quantized)."""
    if not getattr(draft_model, "has_own_embed_tokens", False):
        return False
    target_embed = target_embedding(target_inner)
    draft_embed = getattr(draft_inner, "embed_tokens", None)
    return draft_embed is not None and target_embed is not None and not hasattr(target_embed, "weight")


def wrap_maybe_share_target_embed(original: Callable) -> Callable:
    @functools.wraps(original)
    def maybe_share_target_embed(draft_model, draft_inner, target_inner) -> None:
        from vllm.distributed.parallel_state import get_pp_group

        if not is_dualgpu_run():
            return original(draft_model, draft_inner, target_inner)
        if keeps_own_beside_packed_target(draft_model, draft_inner, target_inner):
            return None
        # Only the case vLLM skips: PP > 1 and a drafter that declares nothing.
        if hasattr(draft_model, "has_own_embed_tokens") or get_pp_group().world_size <= 1:
            return original(draft_model, draft_inner, target_inner)
        target_embed = target_embedding(target_inner)
        if target_embed is None:
            return original(draft_model, draft_inner, target_inner)
        # vLLM's non-PP path for a drafter without has_own_embed_tokens: _should_share() is
        # True, so the drafter's copy is dropped and the target's module takes its place.
        if getattr(draft_inner, "embed_tokens", None) is not None:
            del draft_inner.embed_tokens
        draft_inner.embed_tokens = target_embed
        return None

    return maybe_share_target_embed
