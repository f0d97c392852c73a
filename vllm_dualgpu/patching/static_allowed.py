"""Findings of :mod:`vllm_dualgpu.patching.static_check` that are false alarms, each with why.

Keyed by (the entry's target, the copy-holding module or the overriding ``module:Class``); the
value says why the copy left unrebound or the override left unpatched changes nothing for a
dualgpu run. A real gap is fixed in the entry (a ``copies`` holder, another patch), not here.
Checked against vLLM 0.30.0, 0.31.0, 0.32.0 and 0.33.0.
"""

from __future__ import annotations

_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_CPU_WORKER = "vllm.v1.worker.cpu_worker:CPUWorker"
_XPU_WORKER = "vllm.v1.worker.xpu_worker:XPUWorker"
_NOT_OUR_WORKER = (
    "the package's worker (engine/worker.py) derives from the CUDA Worker itself; vLLM's CPU and "
    "XPU workers are never a dualgpu run's worker"
)
_NOT_CUDA = "a dualgpu run is on NVIDIA GPUs, vLLM's CUDA platform: never this class"
_DFLASH_OTHERS = (
    "vLLM 0.30's Gemma4 DSpark and Laguna DFlash drafters override the build with their own "
    "code (the same raw .weight reads); the entry covers the Qwen3 DFlash family it was written "
    "for (DFlash2, Qwen3 DSpark inherit it) and says these are not covered: a quantized drafter "
    "of those two models fails as in stock vLLM, not made worse"
)

ALLOWED: dict[tuple[str, str], str] = {
    # ROCm-only: the module imports aiter at the top and is never imported on CUDA (the entry's
    # why says so); its copy is not rebound and not reached.
    ("vllm.utils.platform_utils:get_device_name_as_file_name",
     "vllm.model_executor.layers.fused_moe.fused_flydsl_moe"): "ROCm-only (imports aiter)",
    # The CUDA platform inherits Platform's method; XPU's override calls it (reached).
    ("vllm.platforms.interface:Platform.update_block_size_for_backend",
     "vllm.platforms.cpu:CpuPlatform"): _NOT_CUDA,
    ("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._build_context_kv_buffers",
     "vllm.model_executor.models.gemma4_dspark:Gemma4DSparkModel"): _DFLASH_OTHERS,
    ("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._build_context_kv_buffers",
     "vllm.model_executor.models.laguna_dflash:DFlashLagunaModel"): _DFLASH_OTHERS,
    ("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._project_context_kv",
     "vllm.model_executor.models.gemma4_dspark:Gemma4DSparkModel"): _DFLASH_OTHERS,
    ("vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._project_context_kv",
     "vllm.model_executor.models.laguna_dflash:DFlashLagunaModel"): _DFLASH_OTHERS,
    # The flag is set only for a Qwen3-Next/Qwen3.5 decoder (the entry's why): PLaMo 3's own
    # layer choice is meant to stay as vLLM has it.
    ("vllm.model_executor.models.interfaces:EagleModelMixin._set_aux_hidden_state_layers",
     "vllm.model_executor.models.plamo3:Plamo3Model"): "a decoder the entry leaves alone",
    # worker-overrides-*: what the package's worker relies on in the CUDA Worker.
    (f"{_WORKER}.init_device", _CPU_WORKER): _NOT_OUR_WORKER,
    (f"{_WORKER}.init_device", _XPU_WORKER): _NOT_OUR_WORKER,
    (f"{_WORKER}.determine_available_memory", _CPU_WORKER): _NOT_OUR_WORKER,
    (f"{_WORKER}.compile_or_warm_up_model", _CPU_WORKER): _NOT_OUR_WORKER,
}
