"""What both dualgpu executors add to vLLM's own: the plan before the workers start, and the
context check after profiling. ``DualGpuExecutor`` (one host, vLLM's multiprocess executor) and
``DualGpuRayExecutor`` (across machines, vLLM's Ray executor) put this in front of their vLLM
base class. No side effects at import: EngineCore unpickles the config before plugins load.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_dualgpu.log import logger


class PlannedExecutor:
    """Mixin for a vLLM executor class; ``dualgpu`` is the applied plan, or None (stock run)."""

    dualgpu = None

    def start_planned(self, planning_applies: Callable, apply: Callable, stock: str) -> None:
        """Apply the engine's patches and, where ``planning_applies`` says so, the plan
        ``apply(vllm_config)`` makes; call before vLLM's own ``_init_executor``."""
        from vllm_dualgpu import plugin
        from vllm_dualgpu.process import ENGINE

        # With LLM(...) vLLM forks EngineCore, which then skips general plugins: apply the
        # engine-side patches here (a no-op where register() already did).
        plugin.ensure(frozenset({ENGINE}))
        self.dualgpu = None
        why_not = planning_applies(self.parallel_config)
        if why_not is not None:
            logger.info("vllm-dualgpu: %s, running as %s", why_not, stock)
            return
        from vllm_dualgpu.engine import preflight
        from vllm_dualgpu.kernels.flashinfer import apply_flashinfer_autotune_policy

        # The front end refuses this already when an engine starts; a config built on its own
        # (no usage context) reaches the executor unchecked.
        preflight.check_platform(self.parallel_config)
        # A dualgpu run does not start half-patched (required patches, interventions).
        plugin.ensure_for_dualgpu(frozenset({ENGINE}))
        try:
            self.dualgpu = apply(self.vllm_config)
        except (ValueError, RuntimeError) as e:  # the plan's refusals (what fits, what to do)
            # One ERROR line first: vLLM's "EngineCore failed to start" traceback follows.
            logger.error("%s", e)
            raise
        from vllm_dualgpu.engine.attention_backend import apply_common_backend, apply_drafter_backend

        capabilities = [g.capability for g in self.dualgpu.gpus]
        apply_flashinfer_autotune_policy(self.vllm_config.kernel_config, capabilities)
        apply_common_backend(self.vllm_config, capabilities)
        apply_drafter_backend(self.vllm_config, capabilities)
        # The workers know they are in a dualgpu run from their class (DualGpuWorker) and the
        # plan's hand-off in the config they receive (process.is_dualgpu_run): no environment.

    def determine_available_memory(self) -> list[int]:
        available = super().determine_available_memory()
        if self.dualgpu is not None:
            from vllm_dualgpu.engine.context_fit import cap_to_plan, check_context_fits

            available = cap_to_plan(self.vllm_config, available, self.dualgpu)
            check_context_fits(self.vllm_config, self.get_kv_cache_specs(), available, self.dualgpu)
        return available
