"""Per-device ``get_sm_version_num()`` in vLLM's compiled library: install it, ask its state.

vLLM 0.30's ``_C_stable_libtorch`` picks CUTLASS/FP4/MoE kernels by ``get_sm_version_num()``,
which answers for device 0 in every process, so on a mixed pair the second rank dispatches
kernels for the first rank's card. :func:`install_sm_hook` points the library's PLT slot(s) for
that function at a native function (in ``vllm_dualgpu._C``) that answers for the calling
thread's current CUDA device. The mechanism and its limits are in ``docs/sm-hook.md``.

This is not a registry patch (it rewrites machine code's indirection, not a Python attribute);
the dualgpu worker calls :func:`install_sm_hook` once, after its device is set.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_dualgpu import rank_summary
from vllm_dualgpu.log import logger

LIBRARY = "_C_stable_libtorch"
"""Basename prefix of vLLM's library (``_C_stable_libtorch.abi3.so``). A prefix, not a
substring: ``_moe_C_stable_libtorch.abi3.so`` contains the same text and must not match."""
SYMBOL = "_Z18get_sm_version_numv"
"""``int get_sm_version_num()``, as C++ mangles it."""
SUMMARY_KEY = "sm-hook"

_lock = threading.Lock()


class SmHookError(RuntimeError):
    """The hook cannot be installed; the message names what is missing."""


@dataclass(frozen=True)
class HookReport:
    """What :func:`install_sm_hook` did."""

    library: str
    symbol: str
    slots: tuple[int, ...]
    """Addresses of the GOT slots (one per JUMP_SLOT relocation of the symbol)."""
    old_targets: tuple[int, ...]
    """What each slot held before (a lazy-binding PLT stub until the first call)."""
    new_target: int
    rewritten: int
    already: int
    """Slots that already held ``new_target`` (a second install changes nothing)."""
    read_only: bool
    """True when a slot sat on a read-only (full RELRO) page and was written through mprotect."""
    binding: str
    """``now`` when the library is linked with BIND_NOW, else ``lazy``. Python loads extension
    modules with RTLD_NOW, so the slots are usually bound at load time either way."""
    definition: int | None
    """Address of the library's own definition of the symbol (the function now bypassed)."""
    cuda_runtime: str | None
    """The CUDA runtime the per-device function calls; None when the caller chose the target."""
    answer: int | None = None
    """What the per-device function answers on this thread's current device (e.g. 90), read
    right after the install; None when the caller chose the target."""

    def summary(self) -> str:
        what = f"{self.rewritten} PLT slot{'s' if self.rewritten != 1 else ''} rewritten"
        if self.already:
            what += f", {self.already} already hooked"
        olds = ", ".join(sorted({_hex(t) for t in self.old_targets}))
        text = (
            f"{os.path.basename(self.library)} {self.symbol}: {what} "
            f"(old {olds} -> new {_hex(self.new_target)}"
        )
        if self.cuda_runtime:
            text += f", per current device via {os.path.basename(self.cuda_runtime)}"
        if self.answer is not None:
            text += f", answers {self.answer} here"
        if self.read_only:
            text += "; read-only GOT page, written through mprotect"
        return text + ")"


def _hex(address: int | None) -> str:
    return "none" if address is None else f"0x{address:x}"


def _native():
    try:
        native = importlib.import_module("vllm_dualgpu._C")
    except ImportError as exc:
        raise SmHookError(
            f"the native extension vllm_dualgpu._C is not importable ({exc}); reinstall "
            "vllm-dualgpu so its extension is built (it needs a C++ compiler, not CUDA)"
        ) from None
    if not hasattr(native, "plt_hook"):
        raise SmHookError(
            f"the native extension {native.__file__} was built without the sm hook; rebuild it"
        )
    return native


def select_library(loaded: Iterable[str], name: str = LIBRARY) -> str:
    """The one loaded library whose file name starts with ``name``."""
    loaded = list(loaded)
    matches = sorted({p for p in loaded if os.path.basename(p).startswith(name)})
    if not matches:
        raise SmHookError(
            f"no library named {name}* is loaded in this process ({len(loaded)} shared objects "
            f"loaded); vLLM's platform imports vllm.{LIBRARY} first, so this is called too "
            "early or outside a vLLM CUDA process"
        )
    if len(matches) > 1:
        raise SmHookError(f"{len(matches)} loaded libraries match {name}*: {', '.join(matches)}")
    return matches[0]


def install_sm_hook(
    library: str = LIBRARY, symbol: str = SYMBOL, target: int | None = None
) -> HookReport:
    """Point ``symbol``'s PLT slot(s) in the loaded ``library`` at the per-device function.

    ``target`` replaces the per-device function with another native function's address (tests
    and probes use it); by default the CUDA runtime is bound through the library's own
    dependencies first. Idempotent. Raises :class:`SmHookError` naming what is missing.
    """
    with _lock:
        native = _native()
        path = select_library(native.loaded_libraries(), library)
        runtime = None
        if target is None:
            try:
                runtime = native.bind_cuda_runtime(path)
            except RuntimeError as exc:
                raise SmHookError(str(exc)) from None
            target = native.sm_version_hook_address()
        try:
            raw = native.plt_hook(path, symbol, target)
        except (RuntimeError, ValueError) as exc:
            raise SmHookError(str(exc)) from None
        report = HookReport(
            library=raw["library"],
            symbol=symbol,
            slots=tuple(raw["slots"]),
            old_targets=tuple(raw["targets"]),
            new_target=raw["new_target"],
            rewritten=raw["rewritten"],
            already=raw["already"],
            read_only=any(raw["read_only"]),
            binding=raw["binding"],
            definition=raw["definition"],
            cuda_runtime=runtime,
            answer=native.sm_version_current_device() if runtime is not None else None,
        )
    rank_summary.note(SUMMARY_KEY, report.summary())
    logger.debug("vllm-dualgpu sm hook: %s", report.summary())
    return report


def sm_hook_status(library: str = LIBRARY, symbol: str = SYMBOL) -> dict:
    """Where the hook stands in this process; never raises, changes nothing.

    Keys: ``extension`` (importable), ``library`` (path or None), ``slots`` and ``targets``,
    ``hook_address``, ``hooked`` (every slot points at the per-device function),
    ``cuda_runtime``, ``binding``, ``definition``, ``error`` (None or why something is missing).
    """
    status: dict = {
        "extension": False, "library": None, "slots": [], "targets": [], "hook_address": None,
        "hooked": False, "cuda_runtime": None, "binding": None, "definition": None, "error": None,
    }
    try:
        native = _native()
        status["extension"] = True
        status["hook_address"] = native.sm_version_hook_address()
        status["cuda_runtime"] = native.cuda_runtime()
        path = select_library(native.loaded_libraries(), library)
        status["library"] = path
        raw = native.plt_slots(path, symbol)
    except (SmHookError, RuntimeError) as exc:
        status["error"] = str(exc)
        return status
    status.update(
        slots=list(raw["slots"]), targets=list(raw["targets"]), binding=raw["binding"],
        definition=raw["definition"],
    )
    status["hooked"] = bool(raw["targets"]) and all(
        t == status["hook_address"] for t in raw["targets"]
    )
    if not raw["slots"]:
        status["error"] = f"{path} has no PLT slot for {symbol}"
    return status
