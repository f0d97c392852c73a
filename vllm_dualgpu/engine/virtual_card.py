"""A rank on a virtual card (:mod:`vllm_dualgpu.virtual_gpus`): how it presents and is held.

:func:`activate` runs in the worker process before vLLM sets up its device and takes its memory
snapshot, when the hand-off gives the rank a virtual card:

- NCCL: each rank gets its own ``NCCL_HOSTID`` (and ``NCCL_SOCKET_IFNAME=lo`` unless set), so
  NCCL treats the ranks sharing one GPU as hosts of their own and uses its socket transport;
  two ranks on one GPU of one host are otherwise refused ("Duplicate GPU detected");
- memory: the registry's ``virtual-gpus-*`` patches make free and total memory those of the
  card, with this process's own use of the physical GPU (NVML's per-process figure: torch's
  allocations, the CUDA context, NCCL buffers) as the card's used memory, so vLLM's snapshot
  and profile count this rank only (``mem_get_info`` is device-wide on the shared GPU);
- name and capability: vLLM's platform answers the card's name (its tuned-config files are
  looked up by it) and capability (:attr:`VirtualCard.reported_capability`);
- the cap: torch's allocator is limited to the card's free memory less what the process holds
  outside torch (:func:`hold_to_card`, refreshed as the worker goes), so an allocation past the
  card fails with CUDA out-of-memory as on the real card.
"""

from __future__ import annotations

import os
import socket

from vllm_dualgpu.patching.core import like
from vllm_dualgpu.virtual_gpus import VirtualCard

_state: dict = {"card": None, "nvml": None}


def card() -> VirtualCard | None:
    """This process's virtual card, or None (a real card)."""
    return _state["card"]


def activate(virtual: VirtualCard, rank: int) -> list:
    """Make this worker process rank ``rank`` on ``virtual``: NCCL's host id, then the
    registry's virtual-gpus patches (returned as outcomes; a skipped one refuses the run).

    TP groups of emulated ranks reduce through NCCL: vLLM's FlashInfer all-reduce (on by default
    for TP) is for distinct GPUs of one host, and on the one physical GPU it JIT-builds its
    trtllm_comm module for minutes; ``VLLM_ALLREDUCE_USE_FLASHINFER=0`` unless the user set it.
    Set here, in the worker's own process before its device and communicators exist (vLLM
    caches its environment only after that); custom all-reduce is off through the plan."""
    from vllm_dualgpu import plugin

    _state.update(card=virtual)
    host = socket.gethostname()
    os.environ["NCCL_HOSTID"] = f"{host}-dualgpu-virtual-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("VLLM_ALLREDUCE_USE_FLASHINFER", "0")
    return plugin.ensure_virtual_gpus()


def deactivate() -> None:
    """Tests: forget the card (the patches answer the real card again)."""
    _state.update(card=None)


# --- this process's memory on the physical GPU ---------------------------------------------------


def own_process_bytes() -> int:
    """Device memory this process holds on the physical GPU (NVML's per-process figure: torch's
    allocations, the CUDA context, NCCL and library buffers); 0 before the process has a CUDA
    context. Raises RuntimeError when NVML cannot say (the emulation needs it)."""
    import pynvml

    c = card()
    if _state["nvml"] is None:
        pynvml.nvmlInit()
        _state["nvml"] = pynvml.nvmlDeviceGetHandleByIndex(c.physical_id)
    pid = os.getpid()
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(_state["nvml"])
    for p in procs:
        if p.pid == pid:
            used = p.usedGpuMemory
            if used is None:
                raise RuntimeError("NVML does not report per-process GPU memory here; virtual "
                                   "GPUs need it (unset VLLM_DUALGPU_VIRTUAL_GPUS)")
            return int(used)
    return 0


def memory_info() -> tuple[int, int]:
    """``(free, total)`` of this process's virtual card."""
    c = card()
    free = c.free_bytes - own_process_bytes()
    return max(free, 0), c.total_bytes


def hold_to_card(device=None) -> int:
    """Cap torch's allocator so this process stays within its card: the card's free memory less
    what the process holds outside torch now. Returns the cap in bytes."""
    import torch

    c = card()
    if c is None:
        return 0
    device = torch.cuda.current_device() if device is None else device
    outside_torch = max(own_process_bytes() - torch.cuda.memory_reserved(device), 0)
    cap = max(c.free_bytes - outside_torch, 0)
    torch.cuda.set_per_process_memory_fraction(min(cap / c.physical_total_bytes, 1.0), device)
    return cap


# --- wrappers (factories of the registry's virtual-gpus-* patches) --------------------------------


def wrap_memory_info(original):
    """``torch.accelerator.get_memory_info(device_index=None)`` / ``torch.cuda.mem_get_info``:
    the card's free and total memory on a virtual card, the original elsewhere."""

    def memory(*args, **kwargs):
        if card() is None:
            return original(*args, **kwargs)
        return memory_info()

    return like(original, memory)


def _platform_answer(original, field: str):
    """A ``(cls, device_id=0)`` query of vLLM's CUDA platforms answering the card's ``field``."""

    def answer(cls, device_id: int = 0):
        c = card()
        return original(cls, device_id) if c is None else getattr(c, field)

    return like(original, answer)


def wrap_device_name(original):
    """``get_device_name`` of vLLM's CUDA platforms (``cls, device_id``): the card's name."""
    return _platform_answer(original, "name")


def wrap_torch_device_name(original):
    """``torch.cuda.get_device_name(device=None)``: the card's name."""

    def get_device_name(device=None) -> str:
        c = card()
        return original(device) if c is None else c.name

    return like(original, get_device_name)


def wrap_device_capability(original):
    """``get_device_capability`` of vLLM's CUDA platforms: the card's reported capability, in
    vLLM's own ``DeviceCapability`` type."""

    def get_device_capability(cls, device_id: int = 0):
        answer = original(cls, device_id)
        c = card()
        if c is None or answer is None:
            return answer
        major, minor = c.reported_capability
        return answer._replace(major=major, minor=minor)

    return like(original, get_device_capability)


def wrap_device_total_memory(original):
    """``get_device_total_memory`` of vLLM's CUDA platforms: the card's total."""
    return _platform_answer(original, "total_bytes")

