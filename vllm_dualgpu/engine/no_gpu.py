"""The refusal of ``--distributed-executor-backend dualgpu`` where vLLM found no device and NVML
sees no NVIDIA GPU (no driver, no card, or CUDA_VISIBLE_DEVICES hides them all): one line that
says what is missing and to run ``vllm-dualgpu doctor``, and no traceback.

Without a device vLLM 0.30-0.33 fails while ``vllm serve`` builds its argument parser
(``EngineArgs.add_cli_args`` makes a ``DeviceConfig``: "Failed to infer device type"), before
any config exists. So ``patches/arg_utils.py`` calls :func:`check_command_line` from its
``add_cli_args`` wrapper (on the command line vLLM was given, as vLLM's own ``main`` reads
``sys.argv``) and :func:`check_backend` from its ``create_engine_config`` wrapper (``LLM(...)``).
A machine where vLLM did find a device (the CPU platform, say) is left to the executor's
platform check.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

BACKEND = "dualgpu"
FLAG = "--distributed-executor-backend"


def asks_for_dualgpu(argv: Sequence[str]) -> bool:
    """Whether this command line gives ``--distributed-executor-backend dualgpu`` (either
    spelling of the flag, ``=`` or a separate word)."""
    for i, word in enumerate(argv):
        for flag in (FLAG, "--distributed_executor_backend"):
            if word == flag and i + 1 < len(argv) and argv[i + 1] == BACKEND:
                return True
            if word == f"{flag}={BACKEND}":
                return True
    return False


def nvml_sees_no_gpu() -> str | None:
    """Why NVML sees no usable NVIDIA GPU here, or None when it sees one."""
    try:
        import pynvml
    except ImportError:
        return "the NVML library (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver: NVML's shared library is missing or does not start
        return f"NVML does not start ({e}): is the NVIDIA driver installed?"
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return "NVML lists no GPU"
        from vllm_dualgpu.nvml import visible_physical_ids

        try:
            visible = visible_physical_ids(count)
        except ValueError as e:
            return str(e)
        if not visible:
            return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides all {count}"
        return None
    except Exception as e:
        return f"NVML cannot count the GPUs: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def message(reason: str) -> str:
    return (
        f"vllm-dualgpu: no NVIDIA GPU here, and --distributed-executor-backend {BACKEND} needs them: "
        f"{reason}. Run `vllm-dualgpu doctor` to see what is missing (`vllm-dualgpu plan --gpus ...` "
        "plans for cards that are not here)."
    )


def _vllm_found_no_device() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_unspecified()


def refuse_without_gpu() -> None:
    """Refuse (one ERROR line, no traceback; raises PreflightError) when vLLM found no device
    and NVML sees no GPU."""
    if not _vllm_found_no_device():
        return
    reason = nvml_sees_no_gpu()
    if reason is None:
        return
    from vllm_dualgpu.engine.preflight import PreflightError, refuse

    error = PreflightError(message(reason))
    refuse(error)
    raise error


def check_command_line(argv: Sequence[str]) -> None:
    """From ``add_cli_args``: refuse a ``dualgpu`` command line on a machine without a GPU."""
    if asks_for_dualgpu(argv):
        refuse_without_gpu()


def check_backend(backend: object) -> None:
    """From ``create_engine_config``, before vLLM builds the config: the same for
    ``distributed_executor_backend`` as given."""
    if backend == BACKEND or getattr(backend, "__name__", "") == "DualGpuExecutor":
        refuse_without_gpu()
