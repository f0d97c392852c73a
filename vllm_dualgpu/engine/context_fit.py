"""After profiling: does the requested context fit on EVERY rank? If not, say what does.

vLLM checks each rank on its own and names only the first one that fails (vLLM issue #34076),
which need not be the one that limits the context. This check uses vLLM's own KV arithmetic
on every rank and reports the largest ``--max-model-len`` that fits all of them.
"""

from __future__ import annotations

GiB = 1024**3


class ContextDoesNotFit(ValueError):
    def __init__(self, message: str, largest: int):
        super().__init__(message)
        self.largest = largest


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def per_rank_max_len(vllm_config, kv_cache_specs, available: list[int]) -> list[int | None]:
    """vLLM's estimate of the longest request each rank's KV budget holds (None: no KV).

    The groups are the ones vLLM's run-time planning forms with every rank's layers and memory
    known (``vllm_kv.groups_for_ranks``: the package's grouping patches act there, as in the
    allocation; vLLM's grouping where they are not applied); each release's estimators are called through
    :mod:`vllm_dualgpu.engine.vllm_kv` (0.32 changed the block-size helper, 0.33 moved
    them to ``kv_cache_planning`` behind the platform's KV config builder).
    """
    return [lim for lim, _, _ in _per_rank(vllm_config, kv_cache_specs, available)]


def _per_rank(vllm_config, kv_cache_specs, available: list[int]) -> list[tuple[int | None, int, int]]:
    """(longest request, bytes one block takes, tokens a block holds) per rank, by vLLM's
    functions; the block's tokens are the rank's KV specs' (the config's block size can differ)."""
    from vllm_dualgpu.engine import vllm_kv as kv
    from vllm_dualgpu.engine.kv_pricing import quiet_grouping

    with quiet_grouping():  # the allocation, just after, forms the same groups and says so
        groups = kv.groups_for_ranks(vllm_config, kv_cache_specs, available)
    out: list[tuple[int | None, int, int]] = []
    for specs, mem in zip(kv_cache_specs, available):
        projected = kv.project_groups(groups, specs)
        if not projected:
            out.append((None, 0, 0))
            continue
        per_block = kv.pool_bytes_per_block(vllm_config, projected)
        usable = mem - per_block  # the null block
        tokens = max(g.kv_cache_spec.block_size for g in projected)
        out.append((kv.estimate_max_model_len(vllm_config, projected, max(usable, 0)), per_block, tokens))
    return out


def cap_to_plan(vllm_config, available: list[int], applied) -> list[int]:
    """Each rank's KV bytes: vLLM's, at most the plan's KV budget for that rank.

    vLLM sizes the pool from its profile, which runs no attention (skip_attn in vLLM 0.33's
    profile_run) and comes before FlashInfer's workspaces exist, so it can leave a rank more room
    than the rank needs at its peak; the plan's budget is the one its peak prediction (calibrated
    on the virtual pair) was made for, and what ``vllm-dualgpu plan`` printed. Where vLLM's
    profile leaves less, vLLM's stands. A pool the user set (``--num-gpu-blocks-override``,
    ``--kv-cache-memory-bytes``) is left alone. Worker ``r`` is pipeline stage ``r // tp``."""
    from vllm_dualgpu.log import logger

    cc = vllm_config.cache_config
    plan = getattr(applied, "plan", None)
    if plan is None or cc.num_gpu_blocks_override is not None or getattr(cc, "kv_cache_memory_bytes", None):
        return list(available)
    tp = max(1, getattr(applied, "tp_size", 1))
    out = []
    for rank, have in enumerate(available):
        stage = rank // tp
        planned = plan.ranks[stage].kv_budget_bytes if stage < len(plan.ranks) else None
        if planned is not None and 0 < planned < have:
            logger.info("vllm-dualgpu rank %d: vLLM's profile leaves %.2f GiB for the KV cache, the plan "
                        "%.2f GiB: the pool is sized from the plan's (vLLM's profile runs no attention and "
                        "comes before FlashInfer's workspaces)", rank, have / GiB, planned / GiB)
            have = planned
        out.append(have)
    return out


def check_context_fits(vllm_config, kv_cache_specs, available: list[int], applied=None) -> None:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if mc.original_max_model_len == -1 or cc.num_gpu_blocks_override is not None:
        return  # vLLM fits the length itself / the user fixed the pool
    measured = _per_rank(vllm_config, kv_cache_specs, available)
    known = [(lim, r) for r, (lim, _, _) in enumerate(measured) if lim is not None]
    if not known:
        return
    largest, rank = min(known)
    if largest >= mc.max_model_len:
        return
    gpus = getattr(applied, "gpus", None)
    where = f"rank {rank}" + (f" ({gpus[rank].name})" if gpus else "")
    per_rank = ", ".join(
        f"rank {r}: {lim:,} tokens in {available[r] / GiB:.2f} GiB, "
        f"{_size(measured[r][1])} a block of {measured[r][2]:,} tokens"
        for lim, r in known
    )
    raise ContextDoesNotFit(
        f"--max-model-len {mc.max_model_len:,} does not fit: {where} has room for "
        f"{largest:,} tokens of KV cache ({per_rank}). The largest --max-model-len that fits is "
        f"{largest:,}: pass --max-model-len {largest}, or free GPU memory / lower "
        "VLLM_DUALGPU_RESERVE, or use a smaller --kv-cache-dtype (e.g. fp8).",
        largest,
    )
