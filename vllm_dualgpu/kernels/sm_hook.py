"""Per-device compute capability in vLLM's compiled library: install it, ask its state, report it.

vLLM's ``_C_stable_libtorch`` picks CUTLASS/FP4/MoE kernels by the compute capability of device 0
in every process, so on a mixed pair the second rank dispatches kernels for the first rank's card.
vLLM 0.30/0.31 ask through ``get_sm_version_num()``, called through the library's PLT; from 0.32
that function is inlined and the dispatchers call ``cudaDeviceGetAttribute(&v, 75/76, 0)``
through the library's own import slot. :func:`install_sm_hook` points both JUMP_SLOTs (those the
library has) at native functions in ``vllm_dualgpu._C`` that answer for the calling thread's
current CUDA device, and says how many of the library's capability queries that covers
(:mod:`vllm_dualgpu.kernels.sm_coverage`). The mechanism and its limits: ``docs/sm-hook.md``.

This is not a registry patch (it rewrites machine code's indirection, not a Python attribute);
the dualgpu worker calls :func:`install_sm_hook` once, after its device is set.

``python -m vllm_dualgpu.kernels.sm_hook --coverage PATH`` prints the coverage of a library
file (no CUDA, not loaded) and exits non-zero when the hook would cover none of its queries.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import sm_coverage
from vllm_dualgpu.kernels.sm_coverage import ATTR_SYMBOL, Coverage, CoverageError
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
    attribute: SlotChange | None = None
    """The ``cudaDeviceGetAttribute`` import slot(s), rewritten to the per-device shim (None when
    the caller chose the target: only ``symbol`` is touched then)."""
    coverage: Coverage | None = None
    """The library file's capability queries and how many these slots cover."""
    coverage_error: str | None = None
    """Why the coverage could not be analysed (then ``coverage`` is None)."""

    def summary(self) -> str:
        if self.coverage is not None:
            head = f"{self.coverage.covered} of {self.coverage.total} capability queries covered"
        elif self.attribute is not None:
            head = f"coverage not analysed ({self.coverage_error})"
        else:
            head = "probe target"
        parts = [_slot_text(self.symbol, self.rewritten, self.already, self.old_targets, self.new_target)]
        if self.attribute is not None:
            a = self.attribute
            parts.append(_slot_text(a.symbol, a.rewritten, a.already, a.old_targets, a.new_target))
        text = f"{os.path.basename(self.library)}: {head}; " + "; ".join(parts)
        extra = []
        if self.cuda_runtime:
            extra.append(f"per current device via {os.path.basename(self.cuda_runtime)}")
        if self.answer is not None:
            extra.append(f"answers {self.answer} here")
        if self.read_only or (self.attribute is not None and self.attribute.read_only):
            extra.append("read-only GOT page, written through mprotect")
        return text + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class SlotChange:
    """The JUMP_SLOT(s) of one symbol and what the install did to them."""

    symbol: str
    slots: tuple[int, ...]
    old_targets: tuple[int, ...]
    new_target: int
    rewritten: int
    already: int
    read_only: bool


def _slot_text(symbol: str, rewritten: int, already: int, olds, new: int) -> str:
    if not rewritten and not already:
        return f"{symbol}: no PLT slot"
    what = f"{rewritten} PLT slot{'s' if rewritten != 1 else ''} rewritten"
    if already:
        what += f", {already} already hooked"
    old = ", ".join(sorted({_hex(t) for t in olds}))
    return f"{symbol}: {what} (old {old} -> new {_hex(new)})"


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
    if not hasattr(native, "plt_hook_all"):
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
    """Point the loaded ``library``'s JUMP_SLOTs for ``symbol`` and ``cudaDeviceGetAttribute`` at
    the per-device functions, all of them or none.

    The coverage of the library file is analysed first: when the hook would cover none of its
    capability queries nothing is written and it raises. ``target`` replaces the per-device
    function for ``symbol`` with another native function's address and touches only that
    symbol's slots (tests and probes use it). Idempotent. Raises :class:`SmHookError` naming
    what is missing.
    """
    with _lock:
        native = _native()
        path = select_library(native.loaded_libraries(), library)
        if target is not None:
            return _install_probe(native, path, symbol, target)
        try:
            runtime = native.bind_cuda_runtime(path)
        except RuntimeError as exc:
            raise SmHookError(str(exc)) from None
        coverage, why = None, None
        try:
            coverage = sm_coverage.analyse(path, hooked=(symbol, ATTR_SYMBOL))
        except CoverageError as exc:
            why = str(exc)
        if coverage is not None and not coverage.ok:
            raise SmHookError(f"{coverage.line()}; nothing was rewritten: kernels dispatch for GPU 0")
        pairs = [(symbol, native.sm_version_hook_address()), (ATTR_SYMBOL, native.device_attribute_hook_address())]
        try:
            raw_sm, raw_attr = native.plt_hook_all(path, pairs)
        except (RuntimeError, ValueError) as exc:
            raise SmHookError(str(exc)) from None
        report = HookReport(
            **_fields(raw_sm, symbol),
            cuda_runtime=runtime,
            answer=native.sm_version_current_device(),
            attribute=_change(raw_attr),
            coverage=coverage,
            coverage_error=why,
        )
    rank_summary.note(SUMMARY_KEY, report.summary())
    logger.debug("vllm-dualgpu sm hook: %s", report.summary())
    return report


def _change(raw: dict) -> SlotChange:
    return SlotChange(
        symbol=raw["symbol"], slots=tuple(raw["slots"]), old_targets=tuple(raw["targets"]),
        new_target=raw["new_target"], rewritten=raw["rewritten"], already=raw["already"],
        read_only=any(raw["read_only"]),
    )


def _fields(raw: dict, symbol: str) -> dict:
    return dict(
        library=raw["library"], symbol=symbol, slots=tuple(raw["slots"]),
        old_targets=tuple(raw["targets"]), new_target=raw["new_target"], rewritten=raw["rewritten"],
        already=raw["already"], read_only=any(raw["read_only"]), binding=raw["binding"],
        definition=raw["definition"],
    )


def _install_probe(native, path: str, symbol: str, target: int) -> HookReport:
    try:
        raw = native.plt_hook(path, symbol, target)
    except (RuntimeError, ValueError) as exc:
        raise SmHookError(str(exc)) from None
    raw["symbol"] = symbol
    report = HookReport(**_fields(raw, symbol), cuda_runtime=None)
    rank_summary.note(SUMMARY_KEY, report.summary())
    return report


def coverage_report(library: str = LIBRARY) -> str:
    """One line for ``vllm-dualgpu doctor``: what the hook covers in the installed vLLM's library
    (the file, analysed without loading it or CUDA). Never raises."""
    try:
        path = installed_library(library)
        return "sm hook: " + sm_coverage.analyse(path).line()
    except (SmHookError, CoverageError) as exc:
        return f"sm hook: coverage unknown: {exc}"


def installed_library(library: str = LIBRARY) -> str:
    """The file of the installed vLLM's ``library`` (found beside vLLM's package, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SmHookError("vLLM is not installed")
    folder = list(spec.submodule_search_locations)[0]
    names = [n for n in os.listdir(folder) if n.startswith(library) and n.endswith(".so")]
    if not names:
        raise SmHookError(f"the installed vLLM ({folder}) has no {library}*.so (a CPU build?)")
    return select_library([os.path.join(folder, n) for n in names], library)


def sm_hook_status(library: str = LIBRARY, symbol: str = SYMBOL) -> dict:
    """Where the hook stands in this process; never raises, changes nothing.

    Keys: ``extension`` (importable), ``library`` (path or None), ``slots`` and ``targets``
    (``symbol``'s JUMP_SLOTs), ``attribute_slots`` and ``attribute_targets`` (those of
    ``cudaDeviceGetAttribute``), ``hook_address`` and ``attribute_hook_address``, ``hooked``
    (there is a slot and every slot points at its per-device function), ``cuda_runtime``,
    ``binding``, ``definition``, ``error`` (None or why something is missing).
    """
    status: dict = {
        "extension": False, "library": None, "slots": [], "targets": [], "attribute_slots": [],
        "attribute_targets": [], "hook_address": None, "attribute_hook_address": None,
        "hooked": False, "cuda_runtime": None, "binding": None, "definition": None, "error": None,
    }
    try:
        native = _native()
        status["extension"] = True
        status["hook_address"] = native.sm_version_hook_address()
        status["attribute_hook_address"] = native.device_attribute_hook_address()
        status["cuda_runtime"] = native.cuda_runtime()
        path = select_library(native.loaded_libraries(), library)
        status["library"] = path
        raw = native.plt_slots(path, symbol)
        attr = native.plt_slots(path, ATTR_SYMBOL)
    except (SmHookError, RuntimeError) as exc:
        status["error"] = str(exc)
        return status
    status.update(
        slots=list(raw["slots"]), targets=list(raw["targets"]), binding=raw["binding"],
        definition=raw["definition"], attribute_slots=list(attr["slots"]),
        attribute_targets=list(attr["targets"]),
    )
    status["hooked"] = bool(raw["targets"] or attr["targets"]) and all(
        t == status["hook_address"] for t in raw["targets"]
    ) and all(t == status["attribute_hook_address"] for t in attr["targets"])
    if not raw["slots"] and not attr["slots"]:
        status["error"] = f"{path} has no PLT slot for {symbol} or {ATTR_SYMBOL}"
    return status


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m vllm_dualgpu.kernels.sm_hook",
        description="How many device-0 capability queries of a vLLM library the sm hook covers.",
    )
    parser.add_argument("--coverage", metavar="PATH", required=True,
                        help="the library file (e.g. vllm/_C_stable_libtorch.abi3.so); "
                             "'installed' for the installed vLLM's")
    args = parser.parse_args(argv)
    try:
        path = installed_library() if args.coverage == "installed" else args.coverage
        coverage = sm_coverage.analyse(path)
    except (SmHookError, CoverageError) as exc:
        print(f"sm hook coverage: cannot analyse: {exc}")
        return 2
    print(coverage.line())
    return 0 if coverage.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
