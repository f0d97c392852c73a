"""Each rank answers for its own GPU: capability and name of the current CUDA device.

vLLM 0.30 asks ``current_platform.get_device_capability()`` / ``get_device_name()`` with the
default ``device_id=0`` almost everywhere (``has_device_capability``, ``is_device_capability``,
``is_device_capability_family`` and every kernel's ``is_supported()`` go through the first;
``get_device_name_as_file_name()`` and the tuned-config lookups through the second). In a
pipeline rank whose GPU is not device 0 that is the other rank's card.

The wrappers below (factories of registry patches, see ``docs/device-identity.md``) resolve
``device_id=0`` to the rank's own device once CUDA is initialised in the process:

- capability: ``torch.cuda.current_device()`` is a visible ordinal, which is what both CUDA
  platform classes take for capabilities;
- name: ``NvmlCudaPlatform.get_device_name`` takes a *logical* id (mapped through
  ``assigned_physical_gpu_ids``), so the current device is translated back to the logical id
  that names the same physical GPU; ``NonNvmlCudaPlatform`` takes the visible ordinal.

Before CUDA is initialised, and for any other ``device_id``, the original runs unchanged. An
explicit ``device_id=0`` cannot be told from the default (``has_device_capability`` passes it
explicitly), so it means "this rank's device" too once CUDA is up. Answers are cached per
device index (vLLM already caches capabilities).
"""

from __future__ import annotations

import functools

import torch

from vllm_dualgpu.log import logger
from vllm_dualgpu.patching.core import like


def _current_device() -> int | None:
    """The current CUDA device's visible ordinal, or None before CUDA is initialised."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def wrap_get_device_capability(original):
    """``get_device_capability(cls, device_id=0)`` of both CUDA platforms (visible ordinals)."""

    def get_device_capability(cls, device_id: int = 0):
        if device_id == 0:
            current = _current_device()
            if current is not None:
                device_id = current
        return original(cls, device_id)  # vLLM's @cache keys on (cls, device_id)

    return like(original, get_device_capability)


def _logical_id_of_visible(cls, visible: int) -> int:
    """The vLLM logical device id (local rank space) naming the same GPU as ``visible``."""
    from vllm.platforms.interface import get_assigned_physical_gpu_ids

    assigned = get_assigned_physical_gpu_ids()
    if assigned is None:
        # Without an assignment, logical ids index CUDA_VISIBLE_DEVICES like visible ordinals.
        return visible
    physical = cls.visible_device_id_to_physical_device_id(visible)
    try:
        return assigned.index(physical)
    except ValueError:
        raise LookupError(
            f"current CUDA device {visible} (physical GPU {physical}) is not among "
            f"assigned_physical_gpu_ids {assigned}"
        ) from None


def wrap_nvml_get_device_name(original):
    """``NvmlCudaPlatform.get_device_name(cls, device_id=0)``: takes a logical id."""

    @functools.cache
    def name_of(cls, current: int) -> str:
        try:
            logical = _logical_id_of_visible(cls, current)
        except LookupError as exc:
            logger.warning("vllm-dualgpu: %s; device names fall back to vLLM's answer", exc)
            logical = 0
        return original(cls, logical)

    def get_device_name(cls, device_id: int = 0) -> str:
        if device_id == 0:
            current = _current_device()
            if current is not None:
                return name_of(cls, current)
        return original(cls, device_id)

    return like(original, get_device_name)


def wrap_visible_get_device_name(original):
    """``NonNvmlCudaPlatform.get_device_name(cls, device_id=0)``: takes a visible ordinal."""
    cached = functools.cache(original)

    def get_device_name(cls, device_id: int = 0) -> str:
        if device_id == 0:
            current = _current_device()
            if current is not None:
                return cached(cls, current)
        return original(cls, device_id)

    return like(original, get_device_name)


def wrap_get_device_name_as_file_name(original):
    """``vllm.utils.platform_utils.get_device_name_as_file_name(device_id=0)`` (``@cache``d).

    vLLM's cache would pin whichever card answered first, so after CUDA is up the uncached
    body runs once per current device: it asks ``current_platform.get_device_name(0)``, which
    the device-name patches resolve to the current device.
    """
    body = getattr(original, "__wrapped__", original)

    @functools.cache
    def name_of(current: int) -> str:
        return body(0)

    def get_device_name_as_file_name(device_id: int = 0) -> str:
        if device_id == 0:
            current = _current_device()
            if current is not None:
                return name_of(current)
        return original(device_id)

    return like(original, get_device_name_as_file_name)
