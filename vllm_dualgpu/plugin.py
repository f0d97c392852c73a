"""``register()``: what the plugin does in each vLLM process, and the one line it logs there."""

from __future__ import annotations

import importlib.metadata
import threading

from vllm_dualgpu._version import SUPPORTED_VLLM, __version__
from vllm_dualgpu.log import logger
from vllm_dualgpu.patches.core import ALREADY, APPLIED, Outcome, apply_patch, version_in_range
from vllm_dualgpu.process import WORKER, current_process_kinds, dualgpu_active, process_label

_lock = threading.Lock()
_outcomes: list[Outcome] | None = None


def installed_vllm_version() -> str:
    return importlib.metadata.version("vllm")


def select_patches(kinds: frozenset[str], active: bool):
    """The registry entries for this process. Workers of other executors get none."""
    from vllm_dualgpu.patches.registry import PATCHES

    if WORKER in kinds and not active:
        return ()
    return tuple(p for p in PATCHES if kinds.intersection(p.processes))


def register() -> list[Outcome]:
    """Apply the patches for this process once; later calls return the first result."""
    global _outcomes
    with _lock:
        if _outcomes is not None:
            return _outcomes
        kinds = current_process_kinds()
        where = process_label(kinds)
        version = installed_vllm_version()
        if not version_in_range(version, SUPPORTED_VLLM):
            logger.warning(
                "vllm-dualgpu %s supports vLLM %s, found %s: no patches applied and the "
                "'dualgpu' executor is unavailable in this process (%s). Install a vllm-dualgpu "
                "release made for vLLM %s, or vllm==0.30.0.",
                __version__, SUPPORTED_VLLM, version, where, version,
            )
            _outcomes = []
            return _outcomes
        active = dualgpu_active()
        _outcomes = [apply_patch(p, version) for p in select_patches(kinds, active)]
        _log_summary(where, version, active, _outcomes)
        return _outcomes


def _log_summary(where: str, version: str, active: bool, outcomes: list[Outcome]) -> None:
    applied = [o.short() for o in outcomes if o.status in (APPLIED, ALREADY)]
    skipped = [o.short() for o in outcomes if o.status not in (APPLIED, ALREADY)]
    if not outcomes and WORKER in where and not active:
        logger.info(
            "vllm-dualgpu %s (%s, vLLM %s): inactive, this run does not use the dualgpu "
            "executor", __version__, where, version,
        )
        return
    msg = "vllm-dualgpu %s (%s, vLLM %s): applied %s; skipped %s"
    args = (__version__, where, version, ", ".join(applied) or "none", "; ".join(skipped) or "none")
    if skipped:
        logger.warning(msg, *args)
    else:
        logger.info(msg, *args)


def _reset_for_tests() -> None:
    global _outcomes
    with _lock:
        _outcomes = None
