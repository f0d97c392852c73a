"""Patches of ``vllm.engine.arg_utils``: select the executor by the bare name ``dualgpu``
(one host, vLLM's multiprocess executor) or ``dualgpu-ray`` (across machines, vLLM's Ray executor).

Stock vLLM 0.30 refuses ``--distributed-executor-backend dualgpu`` twice: with PP > 1,
``EngineArgs._check_feature_supported`` rejects every string but a few built-in names, and
``Executor.get_class`` resolves other strings as ``module.Class`` paths. Turning the name into
the executor class before ``create_engine_config`` runs passes both checks (the class has
``supports_pp``), pickles by reference into EngineCore and workers, and survives
``vllm.config.replace()`` when workers rebuild the config.
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable

BACKEND_NAME = "dualgpu"
EXECUTOR_QUALNAME = "vllm_dualgpu.executor.DualGpuExecutor"
# The class paths of the same executor: vLLM's module.Class form cannot pass its own PP check
# as a string, so these are resolved to the class like the bare name.
EXECUTOR_PATHS = (EXECUTOR_QUALNAME, "vllm_dualgpu.engine.executor.DualGpuExecutor")
RAY_BACKEND_NAME = "dualgpu-ray"
OUR_EXECUTORS = ("DualGpuExecutor", "DualGpuRayExecutor")


def resolve_backend(value: object) -> object:
    """Map a ``distributed_executor_backend`` value to what vLLM should see.

    ``"dualgpu"`` (or its class path ``vllm_dualgpu.executor.DualGpuExecutor``) and
    ``"dualgpu-ray"`` become the executor classes; every other value (vLLM's
    own names, names a later vLLM adds, dotted class paths, classes, None) passes through
    unchanged, for vLLM to accept or refuse as it would without the plugin.
    """
    if value == BACKEND_NAME or value in EXECUTOR_PATHS:
        from vllm_dualgpu.executor import DualGpuExecutor

        return DualGpuExecutor
    if value == RAY_BACKEND_NAME:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            from vllm_dualgpu.engine.preflight import PreflightError

            raise PreflightError(
                f"--distributed-executor-backend {RAY_BACKEND_NAME} runs on Ray, which is not "
                "installed: pip install 'vllm-dualgpu[ray]' on every machine of the cluster "
                "(docs/multi-node.md)."
            )
        from vllm_dualgpu.engine.ray_executor import DualGpuRayExecutor

        return DualGpuRayExecutor
    return value


def near_miss_hint(value: object) -> str | None:
    """For a bare name vLLM refused that is close to one of ours, the line that names it."""
    if not isinstance(value, str) or "." in value:
        return None
    close = difflib.get_close_matches(value, (BACKEND_NAME, RAY_BACKEND_NAME), n=1)
    if not close:
        return None
    return (f"vllm-dualgpu: --distributed-executor-backend '{value}': did you mean '{close[0]}'? "
            f"('{BACKEND_NAME}' and '{RAY_BACKEND_NAME}' come from vllm-dualgpu; the error below is vLLM's)")


def remember_explicit_utilization(engine_args) -> None:
    """Under dualgpu each rank's budget is its free memory minus a reserve. A utilization the
    user typed (anything but vLLM's default) still caps each rank; the executor reads it here."""
    from vllm.config import CacheConfig

    util = engine_args.gpu_memory_utilization
    if util == CacheConfig.gpu_memory_utilization:
        return
    extra = dict(engine_args.additional_config or {})
    extra["dualgpu"] = {**extra.get("dualgpu", {}), "gpu_memory_utilization": util}
    engine_args.additional_config = extra


def wrap_create_engine_config(original: Callable) -> Callable:
    @functools.wraps(original)
    def create_engine_config(self, usage_context=None, headless=False):
        from vllm_dualgpu.engine import no_gpu, preflight

        no_gpu.check_backend(self.distributed_executor_backend)
        try:
            self.distributed_executor_backend = resolve_backend(self.distributed_executor_backend)
        except preflight.PreflightError as e:
            preflight.refuse(e)
            raise
        name = getattr(self.distributed_executor_backend, "__name__", "")
        ours = name in OUR_EXECUTORS
        if ours:
            remember_explicit_utilization(self)
            config = original(self, usage_context, headless)
        else:
            try:
                return original(self, usage_context, headless)
            except Exception:
                hint = near_miss_hint(self.distributed_executor_backend)
                if hint:
                    from vllm_dualgpu.log import logger

                    logger.error("%s", hint)
                raise
        if ours:
            try:
                # On Ray the cards are the cluster's: the executor counts them on every node.
                local = preflight.nvml_gpu_count() if name == "DualGpuExecutor" else None
                preflight.check(config, local)
                if usage_context is not None:  # an engine starts (vllm serve, LLM(...))
                    preflight.check_platform(config.parallel_config)
            except ValueError as e:  # PreflightError, or a VLLM_DUALGPU_* / partition value
                preflight.refuse(e)
                raise
        return config

    return create_engine_config


HELP_NOTE = (
    " With vllm-dualgpu installed: 'dualgpu' runs pipeline parallelism over mismatched NVIDIA "
    "GPUs, choosing the GPU order, layer split and KV pool (plan it first with "
    "'vllm-dualgpu plan'); 'dualgpu-ray' does the same across machines on vLLM's Ray backend."
)


def wrap_add_cli_args(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_cli_args(parser):
        from vllm_dualgpu.engine import no_gpu

        no_gpu.check_command_line(sys.argv[1:])  # vLLM without a device fails in original()
        parser = original(parser)
        action = getattr(parser, "_option_string_actions", {}).get("--distributed-executor-backend")
        if action is not None and f"'{BACKEND_NAME}'" not in (action.help or ""):
            action.help = (action.help or "").rstrip() + HELP_NOTE
        return parser

    return add_cli_args


def wrap_create_engine_config_unsupported(original: Callable) -> Callable:
    """On a vLLM outside the supported range: refuse 'dualgpu' with the support message."""

    @functools.wraps(original)
    def create_engine_config(self, usage_context=None, headless=False):
        backend = self.distributed_executor_backend
        if backend in (BACKEND_NAME, RAY_BACKEND_NAME, *EXECUTOR_PATHS) or getattr(backend, "__name__", "") in OUR_EXECUTORS:
            from vllm_dualgpu.support import unsupported_reason

            reason = unsupported_reason()
            if reason:
                from vllm_dualgpu.engine import preflight

                shown = backend if isinstance(backend, str) else BACKEND_NAME
                error = preflight.PreflightError(f"--distributed-executor-backend {shown}: {reason}")
                preflight.refuse(error)
                raise error
        return original(self, usage_context, headless)

    return create_engine_config
