"""The GPUs this process may use, read through NVML (no CUDA context is created)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class VisibleGpu:
    physical_id: int  # NVML index (PCI bus order)
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]
    bandwidth_gbps: float | None
    uuid: str
    nvlink: bool | None = None  # an active NVLink; None when NVML cannot say
    pci_bus_id: str | None = None  # e.g. "00000000:01:00.0"; None when NVML cannot say
    display: bool | None = None  # an active display (a desktop holds memory on it); None when NVML cannot say


def _pci_bus_id(pynvml, handle) -> str | None:
    try:
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
    except Exception:
        return None
    return bus.decode() if isinstance(bus, bytes) else str(bus)


def _has_nvlink(pynvml, handle) -> bool | None:
    """Whether any NVLink of the card is active (NCCL then uses more, GPU-resident, buffers)."""
    links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
    saw_answer = False
    for link in range(links):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                return True
            saw_answer = True
        except pynvml.NVMLError as exc:
            # Consumer cards answer "not supported": no NVLink. Past the last link: stop.
            if getattr(exc, "value", None) == getattr(pynvml, "NVML_ERROR_NOT_SUPPORTED", -1):
                return False
            break
        except Exception:
            return None
    return False if saw_answer else None


def _display_active(pynvml, handle) -> bool | None:
    """Whether the card drives a display (a desktop or X server has memory on it): NVML's
    display-active state; None when NVML cannot say (not supported, no such call)."""
    try:
        state = pynvml.nvmlDeviceGetDisplayActive(handle)
    except Exception:
        return None
    return state == getattr(pynvml, "NVML_FEATURE_ENABLED", 1)


def _bandwidth_gbps(pynvml, handle) -> float | None:
    """Peak memory bandwidth from bus width and memory clock (DDR: two transfers a clock)."""
    try:
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        mem_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
    except Exception:
        return None
    if not bus_bits or not mem_mhz:
        return None
    return bus_bits / 8 * mem_mhz * 2 / 1000


def visible_physical_ids(count: int) -> list[int]:
    """NVML indexes of the GPUs CUDA_VISIBLE_DEVICES allows, in the order it lists them.

    Integer entries are read in PCI bus order (the executor exports CUDA_DEVICE_ORDER=PCI_BUS_ID,
    which is also NVML's order).
    """
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None or text.strip() == "":
        return list(range(count))
    ids = []
    for entry in text.split(","):
        entry = entry.strip()
        try:
            ids.append(int(entry))
        except ValueError:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={text!r}: vllm-dualgpu needs integer GPU indexes "
                "(PCI bus order, as nvidia-smi lists them), not UUIDs or MIG names"
            ) from None
        if ids[-1] < 0:
            break  # CUDA stops at the first invalid entry
    ids = [i for i in ids if i >= 0]
    bad = [i for i in ids if i >= count]
    if bad:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={text!r} names GPU {bad[0]}, but NVML sees {count}")
    return ids


def read_visible_gpus() -> list[VisibleGpu]:
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        out = []
        for pid in visible_physical_ids(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(pid)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append(
                VisibleGpu(
                    physical_id=pid,
                    name=name.decode() if isinstance(name, bytes) else name,
                    total_bytes=int(mem.total),
                    free_bytes=int(mem.free),
                    capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                    bandwidth_gbps=_bandwidth_gbps(pynvml, h),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    nvlink=_has_nvlink(pynvml, h),
                    pci_bus_id=_pci_bus_id(pynvml, h),
                    display=_display_active(pynvml, h),
                )
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def to_gpu_facts(gpus: list[VisibleGpu], reserves: list[int] | None = None,
                 caps: list[int] | None = None) -> list:
    """The planner's view of these GPUs (``GpuFacts``), indexed by their position in the list;
    ``caps``: each card's budget ceiling (an explicit --gpu-memory-utilization)."""
    from vllm_dualgpu.planner.gpus import GpuFacts

    return [
        GpuFacts(
            index=i,
            name=g.name,
            total_bytes=g.total_bytes,
            free_bytes=g.free_bytes,
            bandwidth_gbps=g.bandwidth_gbps,
            capability=g.capability,
            reserve_bytes=reserves[i] if reserves else 0,
            nvlink=g.nvlink,
            cap_bytes=caps[i] if caps else None,
            display=g.display,
        ).with_known_defaults()
        for i, g in enumerate(gpus)
    ]


def driver_version() -> str | None:
    """The NVIDIA driver's version string, or None when NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return v.decode() if isinstance(v, bytes) else str(v)
