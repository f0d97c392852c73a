"""The environment variables vllm-dualgpu reads, parsed with errors that say what to write."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence


# Per-GPU memory kept free for other programs (a desktop, a browser), in visible-GPU order.
# Unset: each card keeps what its display state asks for (:func:`default_reserve`).
RESERVE = "VLLM_DUALGPU_RESERVE"
# Kept free on a card that drives a display (a desktop grows and shrinks on it), and on one whose
# display state NVML cannot say: 1 GiB, the margin llama.cpp's --fit keeps by default; the
# reference setup kept 0.6-1.5 GiB free on its desktop card.
DEFAULT_RESERVE_BYTES = 1024**3
# Kept free on a card without a display: nothing else lives there, the margin is for
# fragmentation and the memory model's estimate error. The reference setup ran its headless card
# nearly full; 1 GiB there kept three of its launchers short of 262,144 tokens on a GPU run. (An
# H200 pair at 256 MiB once ran out of memory in FlashInfer autotune's warm-up, before autotune
# was turned off under PP and the pipeline's NCCL buffers were charged: docs/benchmarks.md.)
HEADLESS_RESERVE_BYTES = 256 * 1024**2

# Why a card keeps what it keeps (the executor's log, `plan`'s note).
DISPLAY_ACTIVE = "display active"
NO_DISPLAY = "no display on this card"
DISPLAY_UNKNOWN = "display state unknown"


@dataclass(frozen=True)
class Reserve:
    """The memory kept free on one card and why."""

    bytes: int
    why: str

    def text(self) -> str:
        return f"{self.bytes / 1024**3:.2f} GiB kept free ({self.why})"


def default_reserve(display: bool | None) -> Reserve:
    """What a card keeps free without ``VLLM_DUALGPU_RESERVE``: 1 GiB where it drives a display
    or where that is unknown (NVML cannot say, an offline ``--gpus`` entry without
    ``display=``), 256 MiB where it has none."""
    if display is False:
        return Reserve(HEADLESS_RESERVE_BYTES, NO_DISPLAY)
    return Reserve(DEFAULT_RESERVE_BYTES, DISPLAY_ACTIVE if display else DISPLAY_UNKNOWN)


# Which split the search takes: speed (default), pool or auto (= speed); planner/objective.py.
OBJECTIVE = "VLLM_DUALGPU_OBJECTIVE"
# Where the executor writes the plan it applied, as JSON (optional).
PLAN_FILE = "VLLM_DUALGPU_PLAN_FILE"
# The machine profile `vllm-dualgpu calibrate` writes and `plan` and the executor read
# (default: $XDG_CACHE_HOME/vllm-dualgpu/machine-profile.json; "none": no profile).
MACHINE_PROFILE = "VLLM_DUALGPU_MACHINE_PROFILE"


def objective() -> str:
    """``VLLM_DUALGPU_OBJECTIVE``, else the planner's default objective: the executor and
    ``vllm-dualgpu plan`` both ask the planner with this value (an unknown one is the planner's
    BadRequest)."""
    from vllm_dualgpu.planner.objective import DEFAULT_OBJECTIVE

    return os.environ.get(OBJECTIVE, "").strip().lower() or DEFAULT_OBJECTIVE


def allow_long_max_model_len() -> bool:
    """vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (vllm/envs.py: '1' or 'true'): a --max-model-len
    above the model's maximum is then accepted with a warning. The planner takes it in its
    request (PlanRequest.allow_long_max_model_len)."""
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


_EXPORTED: list = []
"""Every :class:`ExportedVariable` of the package (:func:`forget_exports`)."""


def forget_exports() -> None:
    """Forget every export without touching the environment (tests that restore it)."""
    for var in _EXPORTED:
        var.forget()


class ExportedVariable:
    """An environment variable (vLLM's or torch's) the executor exports for the workers it is about
    to spawn (they inherit it), told apart from the user's own value: a value this process
    exported is never taken back as the user's (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` a second
    ``LLM(...)`` runs in the same process, sees the first run's export, and must plan afresh), and
    the user's own value is never overwritten."""

    def __init__(self, name: str):
        self.name = name
        self.exported: str | None = None
        """The value this process last exported, or None."""
        _EXPORTED.append(self)

    def users_text(self) -> str | None:
        """The user's own value, or None (unset, blank, or this process's export)."""
        text = os.environ.get(self.name)
        if text is None or not text.strip() or text == self.exported:
            return None
        return text

    def export(self, text: str | None) -> None:
        """Export ``text`` where the user set no value of their own; None (or "") takes back an
        earlier export (vLLM's default then applies), leaving a user's own value alone."""
        if text and self.users_text() is None:
            self.exported = text
            os.environ[self.name] = text
            return
        if self.exported is not None and os.environ.get(self.name) == self.exported:
            del os.environ[self.name]
        self.exported = None

    def forget(self) -> None:
        """Forget the export without touching the environment (tests that restore it)."""
        self.exported = None


FLASHINFER_WORKSPACE = "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE"
WORKSPACE = ExportedVariable(FLASHINFER_WORKSPACE)


def export_flashinfer_workspace(size_bytes: int) -> None:
    """The executor's ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``, read by vLLM in every worker that
    runs FlashInfer (``FlashInferMetadataBuilder._get_workspace_buffer``): the plan's size where the
    user did not set it, exported before the workers spawn; 0 takes an earlier export back."""
    WORKSPACE.export(str(int(size_bytes)) if size_bytes > 0 else None)


def flashinfer_workspace_bytes() -> int | None:
    """vLLM's ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE`` (bytes, vllm/envs.py: ``int(...)``), the
    workspace FlashInfer's attention allocates on each rank that runs it; None when unset (a dualgpu
    run then sets its own size, :func:`export_flashinfer_workspace`), set by the executor itself, or not a
    number vLLM reads (vLLM then fails on it with its own error)."""
    text = WORKSPACE.users_text()
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""torch's allocator settings, in the order its allocator reads them (the first one set wins)."""
ALLOCATOR = ExportedVariable("PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class AllocatorChoice:
    """Whether a dualgpu run's workers get torch's expandable segments, and why (one clause)."""

    expandable: bool
    why: str

    def line(self) -> str:
        if self.expandable:
            return f"the workers run with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS}: {self.why}"
        return f"the workers keep torch's allocator as configured: {self.why}"


def _allocator_setting(*, users_only: bool) -> tuple[str, str] | None:
    """The first of torch's allocator variables set, as (variable, value); ``users_only``: not
    this process's own export."""
    for name in ALLOC_CONF_VARS:
        text = ALLOCATOR.users_text() if users_only and name == ALLOCATOR.name else os.environ.get(name)
        if text and text.strip():
            return name, text
    return None


def users_allocator_conf() -> tuple[str, str] | None:
    """The user's own allocator settings as (variable, value), or None (unset, or this process's
    export)."""
    return _allocator_setting(users_only=True)


def allocator_choice(*, tp_size: int = 1, custom_all_reduce: bool = True, sleep_mode: bool = False,
                     kv_transfer: bool = False) -> AllocatorChoice:
    """Expandable segments for the workers unless the user configured torch's allocator or the run
    needs fixed segments. Without them a pass whose tensors have other sizes than the last one's
    (a 4 MP image after a 250K prompt) cannot reuse the blocks torch keeps cached and takes new
    ones: measured 632 MiB more reserved for 256 MiB more allocated on the small card of the
    virtual pair (docs/benchmarks.md, thirteenth run). The reference launchers set it too.
    ``plan`` and the executor both ask this."""
    user = users_allocator_conf()
    if user is not None:
        return AllocatorChoice(False, f"{user[0]}={user[1]} is the user's")
    if tp_size > 1 and custom_all_reduce:
        return AllocatorChoice(False, "vLLM's custom all-reduce shares CUDA graph buffers through CUDA "
                                      "IPC, which expandable segments do not support (vLLM issue #42609)")
    if sleep_mode:
        return AllocatorChoice(False, "sleep mode allocates through vLLM's own memory pool")
    if kv_transfer:
        return AllocatorChoice(False, "vLLM refuses a KV connector with expandable segments")
    return AllocatorChoice(True, "torch's allocator reuses freed memory across passes of other sizes "
                                 "(a PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF of your own is kept)")


def allocator_in_effect() -> str:
    """What torch's allocator in this process was started with, for a rank's summary line."""
    setting = _allocator_setting(users_only=False)
    return "=".join(setting) if setting else "torch's default (no PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF)"


def export_allocator(choice: AllocatorChoice) -> None:
    """Export (or take back) the executor's allocator setting for the workers it spawns."""
    ALLOCATOR.export(EXPANDABLE_SEGMENTS if choice.expandable else None)


def parse_size(text: str, *, what: str = "size") -> int:
    """'1.5GiB' -> bytes: the planner's reader (bare numbers are GiB below 1024, else bytes)."""
    from vllm_dualgpu.planner.gpus import parse_size as _parse

    return _parse(text, what=what)


def parse_reserve_sizes(text: str | None) -> list[int] | None:
    """``VLLM_DUALGPU_RESERVE`` as sizes: one for every GPU, or one per visible GPU ('0,1.5GiB');
    unset or empty: None (each card keeps its :func:`default_reserve`)."""
    if text is None or text.strip() == "":
        return None
    return [parse_size(p, what=RESERVE) for p in text.split(",")]


def expand_reserves(sizes: list[int], num_gpus: int, text: str | None = None) -> list[int]:
    """One reserve per visible GPU from :func:`parse_reserve_sizes`' sizes."""
    if len(sizes) == 1:
        return sizes * num_gpus
    if len(sizes) != num_gpus:
        shown = text if text is not None else ",".join(map(str, sizes))
        raise ValueError(
            f"{RESERVE}={shown!r} names {len(sizes)} reserves for {num_gpus} visible GPUs; give "
            f"one value for all or exactly {num_gpus} comma-separated values in visible-GPU order"
        )
    return list(sizes)


def card_reserves(sizes: list[int] | None, displays: Sequence[bool | None],
                  text: str | None = None) -> list[Reserve]:
    """The reserve of each visible GPU (``displays``: each card's display state, in visible-GPU
    order): ``VLLM_DUALGPU_RESERVE``'s sizes where it is set, else each card's
    :func:`default_reserve`. The executor and ``vllm-dualgpu plan`` both ask this."""
    if sizes is None:
        return [default_reserve(d) for d in displays]
    return [Reserve(b, RESERVE) for b in expand_reserves(sizes, len(displays), text)]


def reserves(text: str | None, displays: Sequence[bool | None]) -> list[Reserve]:
    """``VLLM_DUALGPU_RESERVE``'s text (None: unset) for GPUs with these display states."""
    return card_reserves(parse_reserve_sizes(text), displays, text)


def parse_partition(text: str | None, num_layers: int, pp_size: int) -> list[int] | None:
    """A user's ``VLLM_PP_LAYER_PARTITION``, checked the way vLLM will check it."""
    if text is None or text.strip() == "":
        return None
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(
            f"VLLM_PP_LAYER_PARTITION={text!r} is not a comma-separated list of layer counts"
        ) from None
    if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
        raise ValueError(
            f"VLLM_PP_LAYER_PARTITION={text!r} must give {pp_size} positive layer counts "
            f"summing to the model's {num_layers} layers"
        )
    return parts


# --- tool-call parser fixes (issue #16; patches/tool_parsers_qwen3_xml.py) ---
# 0 (or false/no/off) leaves vLLM's tool parsers as shipped: the registry entries that name it in
# Patch.opt_out are not applied (they fix vLLM's front end for every executor, not only dualgpu).
TOOL_PARSER_FIXES = "VLLM_DUALGPU_TOOL_PARSER_FIXES"
