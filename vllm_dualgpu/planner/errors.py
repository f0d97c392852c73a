"""Errors the planner raises. Each message says what is wrong and what to do about it."""

from __future__ import annotations

GIB = 1 << 30


def gib(n: int | float) -> str:
    """Bytes as a short string: ``'2.37 GiB'``, or ``'1.78 MiB'`` below 1 GiB."""
    if abs(n) < GIB:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / GIB:.2f} GiB"


def _kv_is_fp8(kv_cache_dtype: str | None) -> bool:
    return bool(kv_cache_dtype) and str(kv_cache_dtype).lower().startswith("fp8")


class PlanError(ValueError):
    """Base class: the request cannot be planned as asked."""


class BadRequest(PlanError):
    """The request contradicts itself or the model (wrong partition length, too few GPUs, ...)."""


class UnsupportedModel(PlanError):
    """The config describes something the planner cannot size (MLA, sliding windows, ...)."""


class ContextTooLong(PlanError):
    """The requested ``--max-model-len`` does not fit on any split.

    ``largest_fitting_max_model_len`` is the largest value that does fit (0 when even one token
    does not; then :class:`ModelDoesNotFit` is raised instead). The message names the layer split
    that reaches it (the ``partition`` argument). The plan at that length is not carried here:
    :func:`vllm_dualgpu.planner.fit` returns it (``Fit.plan``) without raising.
    """

    def __init__(
        self,
        largest_fitting_max_model_len: int,
        requested: int,
        *,
        partition: list[int] | tuple[int, ...] | None = None,
        hint: str = "",
        kv_cache_dtype: str | None = None,
    ) -> None:
        self.largest_fitting_max_model_len = largest_fitting_max_model_len
        self.requested = requested
        where = ""
        if partition is not None and len(partition) > 1:
            where = f" (layer split {'/'.join(map(str, partition))})"
        fp8 = "" if _kv_is_fp8(kv_cache_dtype) else "--kv-cache-dtype fp8, "
        msg = (
            f"--max-model-len {requested:,} does not fit: the largest that fits is "
            f"{largest_fitting_max_model_len:,}{where}; lower --max-model-len to at most "
            f"{largest_fitting_max_model_len}, or use {fp8}a smaller weight format, or free GPU memory"
        )
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


class ModelDoesNotFit(PlanError):
    """The weights plus fixed costs do not fit: ``rank`` (on ``gpu_name``) is ``short_bytes`` short.

    Reported for the split that comes closest to fitting (``partition``; None or one entry for a
    single card). ``kv_cache_dtype``: the request's, so that the advice leaves out fp8 KV when it
    is already given.
    """

    def __init__(
        self,
        rank: int,
        gpu_name: str,
        short_bytes: int,
        *,
        partition: list[int] | None = None,
        what: str = "the weights, fixed costs and one request's KV cache",
        hint: str = "",
        shortfalls: list[tuple[int, str, int]] | None = None,
        kv_cache_dtype: str | None = None,
    ) -> None:
        self.rank = rank
        self.gpu_name = gpu_name
        self.short_bytes = short_bytes
        self.partition = list(partition) if partition else None
        #: every short rank of that split: (rank, gpu name, bytes short)
        self.shortfalls = list(shortfalls) if shortfalls else [(rank, gpu_name, short_bytes)]
        split = (f" with layer split {'/'.join(map(str, partition))}, the split that comes closest,"
                 if partition and len(partition) > 1 else "")
        others = [f"rank {r} ({n}) by {gib(b)}" for r, n, b in self.shortfalls if r != rank]
        also = f" (and {', '.join(others)})" if others else ""
        fp8 = "" if _kv_is_fp8(kv_cache_dtype) else " --kv-cache-dtype fp8,"
        msg = (
            f"the model does not fit: rank {rank} ({gpu_name}) is short by {gib(short_bytes)}{also}"
            f"{split} for {what}; use a smaller weight format (fp8, W4A16/NVFP4),{fp8} a shorter "
            "--max-model-len, free memory on that card, or add a GPU"
        )
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)
