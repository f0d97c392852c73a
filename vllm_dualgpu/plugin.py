"""``register()``: what the plugin does in each vLLM process, and the one line it logs there."""

from __future__ import annotations

import importlib.metadata
import os
import threading

from vllm_dualgpu._version import __version__
from vllm_dualgpu import support
from vllm_dualgpu.log import ensure_vllm_logging, logger
from vllm_dualgpu.patching.core import ALREADY, APPLIED, Outcome, apply_patch, opted_out, version_in_range
from vllm_dualgpu.process import DEVICE, WORKER, current_process_kinds, is_dualgpu_run, process_label

_lock = threading.Lock()
# What this process applied: {"pid", "kinds", "outcomes"}. Keyed by pid because vLLM forks its
# engine and worker processes by default (``LLM(...)``): a forked child inherits the parent's
# state, and vLLM's own "plugins already loaded" flag keeps it from calling register() again.
_state: dict = {"pid": None, "kinds": frozenset(), "outcomes": None}


def installed_vllm_version() -> str:
    return importlib.metadata.version("vllm")


def select_patches(kinds: frozenset[str], active: bool):
    """The registry entries for this process. Worker and device entries only where the process
    knows it is in a dualgpu run (``active``): other executors' workers get none. An entry the
    user opted out of (Patch.opt_out) is left out."""
    from vllm_dualgpu.patching.registry import PATCHES

    if not active:
        kinds = frozenset(kinds) - {WORKER, DEVICE}
    return tuple(p for p in PATCHES
                 if kinds.intersection(p.processes) and not opted_out(p) and not p.when)


def ensure_virtual_gpus() -> list[Outcome]:
    """The virtual-GPU emulation's patches (``Patch.when == "virtual-gpus"``), in a worker whose
    hand-off gives it a virtual card (vllm_dualgpu.engine.virtual_card.activate). Idempotent; a
    skipped one refuses the run (:class:`StartupRefused`): an emulation that half applies would
    measure the physical GPU and call it the card."""
    from vllm_dualgpu.patching.registry import PATCHES, VIRTUAL_GPUS

    version = installed_vllm_version()
    outcomes = [apply_patch(p, version) for p in PATCHES
                if p.when == VIRTUAL_GPUS and version_in_range(version, p.vllm_versions)]
    skipped = [o.short() for o in outcomes if o.status not in (APPLIED, ALREADY)]
    if skipped:
        refuse_start("worker, virtual GPUs", [f"virtual-GPU patch {s} was skipped" for s in skipped])
    return outcomes


def register() -> list[Outcome]:
    """Entry point body: apply the patches for this process once and log one line.

    A worker process does not know here which executor drives it (vLLM loads plugins before
    it builds the worker): the dualgpu worker applies the worker patches itself
    (:func:`ensure_for_dualgpu`)."""
    return ensure(current_process_kinds(), is_dualgpu_run())


def ensure(kinds: frozenset[str], active: bool = False) -> list[Outcome]:
    """Apply the patches of `kinds` in this process unless done already (idempotent).

    register() calls it with the kinds read from the process name; the executor (EngineCore)
    and the worker class call it with their own kind, which covers forked processes where
    vLLM does not run plugins again. Worker and device patches apply only when ``active`` (a
    process of a dualgpu run). A kind counts as done only once all of its patches were tried:
    an exception part-way leaves it to the next call.
    """
    ensure_vllm_logging()
    with _lock:
        if _state["pid"] != os.getpid():
            _state.update(pid=os.getpid(), kinds=frozenset(), outcomes=None)
        asked = frozenset(kinds) if active else frozenset(kinds) - {WORKER, DEVICE}
        new = asked - _state["kinds"]
        if _state["outcomes"] is not None and not new:
            return _state["outcomes"]
        where = process_label(_state["kinds"] | frozenset(kinds))
        version = installed_vllm_version()
        reason = support.unsupported_reason(version)
        if reason:
            if _state["outcomes"] is None:
                logger.warning("%s; the plugin stays off in this process (%s)", reason, where)
            # Only the guard that refuses the dualgpu backend with that message applies here.
            guards = [apply_patch(p, version) for p in select_patches(new, True)
                      if version_in_range(version, p.vllm_versions)]
            _state.update(kinds=_state["kinds"] | new, outcomes=(_state["outcomes"] or []) + guards)
            return _state["outcomes"]
        # An entry whose range leaves this vLLM out is for other releases: not applied, not
        # reported as skipped (doctor still lists it).
        outcomes = [apply_patch(p, version) for p in select_patches(new, active)
                    if version_in_range(version, p.vllm_versions)]
        _state.update(kinds=_state["kinds"] | new, outcomes=(_state["outcomes"] or []) + outcomes)
        if new == {DEVICE}:
            _note_device_phase(outcomes)
        else:
            _log_summary(where, version, active, outcomes)
        return _state["outcomes"]


def required_patches(kinds: frozenset[str], version: str) -> list:
    """The patches a dualgpu process of ``kinds`` must have applied on vLLM ``version``: from
    the registry, whatever this process happened to try. Conditional entries (``Patch.when``)
    are not among them: their own step applies and requires them (:func:`ensure_virtual_gpus`)."""
    from vllm_dualgpu.patching.registry import PATCHES

    return [p for p in PATCHES if frozenset(kinds).intersection(p.processes) and not p.optional
            and not p.when and not opted_out(p) and version_in_range(version, p.vllm_versions)]


class StartupRefused(RuntimeError):
    """A dualgpu run cannot start in this process: the message says why and what to do."""


def ensure_for_dualgpu(kinds: frozenset[str]) -> list[Outcome]:
    """:func:`ensure` for a process of a dualgpu run, which must not go on half-patched.

    A required patch (``optional=False``) that was skipped, or an intervention of ``kinds``
    whose vLLM target is missing or different (:mod:`vllm_dualgpu.patching.interventions`),
    makes it log one ERROR line and raise :class:`StartupRefused` with the same line. Outside
    a dualgpu run :func:`ensure` only warns: other executors run as stock vLLM.
    """
    outcomes = ensure(kinds, active=True)
    problems = startup_problems(kinds, outcomes)
    if problems:
        refuse_start(process_label(frozenset(kinds)), problems)
    return outcomes


def refuse_start(where: str, problems: list[str]) -> None:
    """Log the refusal as one ERROR line and raise :class:`StartupRefused` with it."""
    message = refusal_message(where, problems)
    logger.error("%s", message)
    raise StartupRefused(message)


def startup_problems(kinds: frozenset[str], outcomes: list[Outcome]) -> list[str]:
    """What keeps a dualgpu run from starting here: required patches that did not apply, and
    interventions of ``kinds`` that do not hold for the installed vLLM."""
    from vllm_dualgpu.patching.interventions import MISSING, check_all

    version = installed_vllm_version()
    unsupported = support.unsupported_reason(version)
    if unsupported:
        return [unsupported]
    problems = []
    for patch in required_patches(frozenset(kinds), version):
        mine = [o for o in outcomes if o.patch.name == patch.name]
        if not mine:
            problems.append(f"required patch {patch.name} was not applied in this process")
        elif not any(o.status in (APPLIED, ALREADY) for o in mine):
            problems.append(f"required patch {mine[-1].short()} was skipped")
    problems += [
        f"{f.intervention.kind} {f.short()} does not hold"
        for f in check_all(version, frozenset(kinds))
        if f.status == MISSING
    ]
    return problems


def refusal_message(where: str, problems: list[str]) -> str:
    version = installed_vllm_version()
    return (
        f"vllm-dualgpu: the dualgpu run cannot start ({where}, vLLM {version}): "
        f"{'; '.join(problems)}. The installed vLLM differs from the one this package was "
        f"written for: install a vLLM release in {support.SUPPORTED_VLLM} that `vllm-dualgpu doctor` "
        "passes, or run stock vLLM with --distributed-executor-backend mp."
    )


def _note_device_phase(outcomes: list[Outcome]) -> None:
    """The device phase goes into the rank's summary line (one INFO line per process already
    came from register()); a skipped patch still gets its WARNING."""
    from vllm_dualgpu import rank_summary

    applied, skipped = _applied_and_skipped(outcomes)
    if skipped:
        logger.warning("vllm-dualgpu (worker, pid %d): once the device was set, skipped %s",
                       os.getpid(), "; ".join(skipped))
    if outcomes:
        text = ", ".join(applied) or "none"
        if skipped:
            text += f"; skipped {'; '.join(skipped)}"
        rank_summary.note("patched once the device was set", text)


def _applied_and_skipped(outcomes: list[Outcome]) -> tuple[list[str], list[str]]:
    applied = [o.short() for o in outcomes if o.status in (APPLIED, ALREADY)]
    skipped = [o.short() for o in outcomes if o.status not in (APPLIED, ALREADY)]
    return applied, skipped


def _log_summary(where: str, version: str, active: bool, outcomes: list[Outcome]) -> None:
    applied, skipped = _applied_and_skipped(outcomes)
    if not outcomes and WORKER in where and not active:
        logger.info(
            "vllm-dualgpu %s (%s, pid %d, vLLM %s): nothing applied yet; the dualgpu worker "
            "applies the worker patches when it starts (none under other executors)",
            __version__, where, os.getpid(), version,
        )
        return
    # The pid tells the processes apart: a spawned worker logs this before vLLM prefixes its
    # lines with the process name.
    msg = "vllm-dualgpu %s (%s, pid %d, vLLM %s): applied %s; skipped %s"
    args = (__version__, where, os.getpid(), version, ", ".join(applied) or "none", "; ".join(skipped) or "none")
    if skipped:
        logger.warning(msg, *args)
    else:
        logger.info(msg, *args)


def _reset_for_tests() -> None:
    with _lock:
        _state.update(pid=None, kinds=frozenset(), outcomes=None)
