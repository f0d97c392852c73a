"""The one list of run-time patches this package makes to vLLM.

``docs/patches.md`` is generated from it (``python -m vllm_dualgpu.patching.docs``), and a test
fails when the file is stale. Each entry says what it changes, where, for which vLLM releases,
why, which upstream issue or PR it relates to, and when it can go.
"""

from __future__ import annotations

from dataclasses import replace

from vllm_dualgpu._version import UNSUPPORTED_VLLM
from vllm_dualgpu.envs import TOOL_PARSER_FIXES
from vllm_dualgpu.patching.core import Patch
from vllm_dualgpu.process import DEVICE, ENGINE, FRONTEND, WORKER

VIRTUAL_GPUS = "virtual-gpus"
"""Patch.when of the emulation entries (vllm_dualgpu.virtual_gpus)."""

# The releases each range was checked against: 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0 (no patch releases
# exist between them). A range ends where upstream fixed the problem or moved the target; then
# another entry (a name with a suffix) covers the later releases.
V030 = ">=0.30.0,<0.31"
V030_034 = ">=0.30.0,<0.35"
V030_033 = ">=0.30.0,<0.34"
V030_031 = ">=0.30.0,<0.32"
V030_032 = ">=0.30.0,<0.33"
V031_034 = ">=0.31.0,<0.35"
V032_034 = ">=0.32.0,<0.35"
V033 = ">=0.33.0,<0.34"
V033_034 = ">=0.33.0,<0.35"
V034 = ">=0.34.0,<0.35"

# Why an entry has no draft in upstream/ (the field upstream_draft; upstream/README.md).
NO_DRAFT_EXECUTOR_NAME = (
    "none: the plugin's own executor name; upstream would need a registry of executor names "
    "for plugins, a design question rather than a fix"
)
NO_DRAFT_ENV_VARS = (
    "none: the plugin's own variables; upstream would need a way for plugins to declare them"
)
NO_DRAFT_DEVICE_NAMES = (
    "none yet: the follow-up of upstream/per-device-capability (names feed @cache'd tuned-config "
    "lookups, so the change is larger)"
)
NO_DRAFT_KV_GROUPS = (
    "none yet: the grouping is chosen by the tightest rank's memory, which vLLM's KV planner does "
    "not see before upstream/per-rank-memory-reserve; a larger change"
)
NO_DRAFT_AUX_RELAY = (
    "none: vLLM PR #45985 (open) relays auxiliary hidden states for every EAGLE3 model"
)
NO_DRAFT_HYBRID_BLOCK = (
    "none yet: a small change to update_block_size_for_backend, but it needs a hybrid model run "
    "under PP on GPUs to show the mismatch"
)
NO_DRAFT_PARSER = "none yet: a tool-parser fix, outside the mismatched-GPU pieces drafted first"

# One fix, two pins: vLLM 0.34 reworded the method's refusal message (cutlass-block-fp8-per-rank-034).
_CUTLASS_BLOCK_FP8_PER_RANK = Patch(
    name="cutlass-block-fp8-per-rank",
    target="vllm.model_executor.kernels.linear.scaled_mm.cutlass:CutlassFp8BlockScaledMMKernel.is_supported",
    processes=(WORKER,),
    vllm_versions=V030_033,
    why=(
        "CutlassFp8BlockScaledMMKernel.is_supported reads CUTLASS_BLOCK_FP8_SUPPORTED, which "
        "w8a8_utils computes once at import from device 0's capability; a worker imports it "
        "with its worker class, before it sets its device, so every rank gets device 0's "
        "answer. On a mixed pair an SM 8.9 rank behind an SM 9.0+ device 0 selects CUTLASS "
        "block FP8, which its card cannot run (seen on the virtual pair: the rank presenting "
        "8.9 logged 'Selected CutlassFp8BlockScaledMMKernel'), and an SM 12.0 rank behind an "
        "SM 8.9 device 0 loses it. The replacement mirrors the method with vLLM's own "
        "cutlass_block_fp8_supported() asked at the call, when the rank's device is set."
    ),
    upstream="none found (vLLM issue #58241 is about CUTLASS block FP8 and SM89, not this)",
    remove_when="vLLM asks the current device in CutlassFp8BlockScaledMMKernel.is_supported",
    factory="vllm_dualgpu.patches.linear_kernels:wrap_cutlass_block_fp8_is_supported",
    params=("cls", "compute_capability"),
    issue="#4",
    source_sha256="af191e31d7d2f308c5f2b55bbefa0a37e2d5d4a027029e50be9b402918c3ffc6",
    upstream_draft="upstream/per-device-capability",
)


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="executor-by-name",
        target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        processes=(FRONTEND,),
        vllm_versions=V030_034,
        why=(
            "Turns --distributed-executor-backend dualgpu into the DualGpuExecutor class (and "
            "dualgpu-ray into DualGpuRayExecutor, vLLM's Ray executor planned across machines) "
            "before vLLM validates it: EngineArgs._check_feature_supported rejects any other "
            "string with PP > 1 and Executor.get_class cannot resolve a bare name. Every other "
            "name goes to vLLM unchanged; when vLLM refuses one close to 'dualgpu', one ERROR "
            "line names it. dualgpu where vLLM found no device and NVML sees no GPU gets one "
            "line naming vllm-dualgpu doctor."
        ),
        upstream="none (vLLM has no registry of executor names for plugins)",
        remove_when="vLLM lets plugins register executor backends by name",
        factory="vllm_dualgpu.patches.arg_utils:wrap_create_engine_config",
        params=("self", "usage_context", "headless"),
        issue="#2",
        upstream_draft=NO_DRAFT_EXECUTOR_NAME,
    ),
    Patch(
        name="dualgpu-needs-supported-vllm",
        target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        processes=(FRONTEND,),
        vllm_versions=UNSUPPORTED_VLLM,
        why=(
            "Outside the supported range no other patch applies, so --distributed-executor-"
            "backend dualgpu with PP > 1 would die on vLLM's own 'Pipeline Parallelism without "
            "Ray distributed executor or multiprocessing executor' error, which names neither "
            "the plugin nor the fix. On such a release this guard refuses 'dualgpu' when the "
            "engine arguments are turned into a config, with one line: the supported range, "
            "the installed vLLM and what to install (vllm_dualgpu.support.unsupported_reason). "
            "Every other backend is untouched."
        ),
        upstream="none (vLLM has no registry of executor names for plugins)",
        remove_when="executor-by-name goes",
        factory="vllm_dualgpu.patches.arg_utils:wrap_create_engine_config_unsupported",
        params=("self", "usage_context", "headless"),
        issue="#16",
        upstream_draft=NO_DRAFT_EXECUTOR_NAME,
    ),
    Patch(
        name="known-env-vars",
        target="vllm.envs:validate_environ",
        processes=(FRONTEND,),
        vllm_versions=V030,
        why=(
            "vLLM warns about (or, with fail_on_environ_validation, refuses) every VLLM_* "
            "variable it does not know, which would flag VLLM_DUALGPU_RESERVE and the other "
            "variables of this package in every run. The wrapper hides VLLM_DUALGPU_* from "
            "that one check; every other variable is checked as before."
        ),
        upstream="none (vLLM has no way for plugins to declare environment variables)",
        remove_when="vLLM lets plugins declare their environment variables",
        factory="vllm_dualgpu.patches.vllm_envs:wrap_validate_environ",
        params=("hard_fail",),
        issue="#3",
        upstream_draft=NO_DRAFT_ENV_VARS,
    ),
    Patch(
        name="known-env-vars-031",
        target="vllm.platforms.interface:Platform.validate_environ",
        processes=(FRONTEND,),
        vllm_versions=V031_034,
        why=(
            "known-env-vars for vLLM 0.31+, where vllm.envs.validate_environ is gone and the "
            "same loop is the classmethod Platform.validate_environ(cls, hard_fail) "
            "(platforms/interface.py:1344 in 0.31, :1458 in 0.33), called as "
            "current_platform.validate_environ(...) from EngineArgs.create_engine_config; no "
            "platform overrides it (patching/static_check.py looks for overrides in every "
            "release). Platform.additional_env_vars is not a way to declare them "
            "(only ROCm sets it)."
        ),
        upstream="none (vLLM has no way for plugins to declare environment variables)",
        remove_when="vLLM lets plugins declare their environment variables",
        factory="vllm_dualgpu.patches.vllm_envs:wrap_platform_validate_environ",
        params=("cls", "hard_fail"),
        issue="#3",
        upstream_draft=NO_DRAFT_ENV_VARS,
    ),
    # --- memory accounting (issue #3) ---
    # --- per-rank device identity (issue #4) ---
    Patch(
        name="capability-per-rank",
        target="vllm.platforms.cuda:NvmlCudaPlatform.get_device_capability",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "get_device_capability() defaults to device 0, and has_device_capability, "
            "is_device_capability(_family) and every kernel's is_supported() call it that way: "
            "on a mixed pair the second rank selects kernels for the first rank's card. Once "
            "CUDA is initialised in the worker, device_id=0 means the current device (a visible "
            "ordinal, as this method takes); vLLM's cache keeps one answer per device."
        ),
        upstream="none in vLLM (the same device-0 gates are reported in the 1CatAI/1Cat-vLLM "
        "fork, issue #412)",
        remove_when="vLLM's capability queries default to the current device",
        factory="vllm_dualgpu.patches.device_identity:wrap_get_device_capability",
        params=("cls", "device_id"),
        issue="#4",
        upstream_draft="upstream/per-device-capability",
    ),
    Patch(
        name="capability-per-rank-nonnvml",
        target="vllm.platforms.cuda:NonNvmlCudaPlatform.get_device_capability",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "Same as capability-per-rank for the platform class vLLM uses where NVML is "
            "unavailable (torch.cuda.get_device_capability(0) on every rank)."
        ),
        upstream="none in vLLM",
        remove_when="vLLM's capability queries default to the current device",
        factory="vllm_dualgpu.patches.device_identity:wrap_get_device_capability",
        params=("cls", "device_id"),
        issue="#4",
        upstream_draft="upstream/per-device-capability",
    ),
    Patch(
        name="device-name-per-rank",
        target="vllm.platforms.cuda:NvmlCudaPlatform.get_device_name",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "get_device_name() defaults to logical device 0, which names the first rank's card "
            "on every rank (tuned-config file names, attention heuristics). Once CUDA is "
            "initialised, device_id=0 names the current device: its visible ordinal is mapped "
            "back to the logical id of the same physical GPU (assigned_physical_gpu_ids), and "
            "the answer is cached per device."
        ),
        upstream="none in vLLM",
        remove_when="vLLM's device-name queries default to the current device",
        factory="vllm_dualgpu.patches.device_identity:wrap_nvml_get_device_name",
        params=("cls", "device_id"),
        issue="#4",
        upstream_draft=NO_DRAFT_DEVICE_NAMES,
    ),
    Patch(
        name="device-name-per-rank-nonnvml",
        target="vllm.platforms.cuda:NonNvmlCudaPlatform.get_device_name",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "Same as device-name-per-rank for the platform class used without NVML, which takes "
            "a visible ordinal (torch.cuda.get_device_name)."
        ),
        upstream="none in vLLM",
        remove_when="vLLM's device-name queries default to the current device",
        factory="vllm_dualgpu.patches.device_identity:wrap_visible_get_device_name",
        params=("cls", "device_id"),
        issue="#4",
        upstream_draft=NO_DRAFT_DEVICE_NAMES,
    ),
    Patch(
        name="config-file-name-per-rank",
        target="vllm.utils.platform_utils:get_device_name_as_file_name",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "The card name in tuned-config file names (fused MoE, block FP8, Mamba SSM) comes "
            "from this @cache'd function with device_id=0, so every rank reads the first rank's "
            "configs. Once CUDA is initialised it answers for the current device (through the "
            "device-name patches), cached per device. fused_flydsl_moe also imports it but is "
            "ROCm-only (it imports aiter) and never loads on CUDA."
        ),
        upstream="none in vLLM",
        remove_when="vLLM names tuned configs by the current device",
        factory="vllm_dualgpu.patches.device_identity:wrap_get_device_name_as_file_name",
        params=("device_id",),
        copies=(
            "vllm.model_executor.layers.fused_moe.fused_moe",
            "vllm.model_executor.layers.quantization.utils.fp8_utils",
            "vllm.model_executor.layers.mamba.ops.mamba_ssm",
        ),
        issue="#4",
        upstream_draft=NO_DRAFT_DEVICE_NAMES,
    ),
    # --- Triton FP8 configs (issue #5) ---
    Patch(
        name="fp8-configs-per-rank",
        target="vllm.model_executor.layers.quantization.utils.fp8_utils:get_w8a8_block_fp8_configs",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "The block-FP8 Triton GEMM reads its tuned configs only from vLLM's own configs/ "
            "folder (VLLM_TUNED_CONFIG_FOLDER is not honoured there) and by device 0's name on "
            "every rank. Once CUDA is initialised the lookup (cached per shape and card) names "
            "the current device and searches the folders in VLLM_DUALGPU_KERNEL_CONFIGS, then "
            "the package's kernel_configs/, then vLLM's folder; unreadable or unsafe files are "
            "skipped with a warning. Each rank logs where it searches once and lists every "
            "shape's source in its summary line (fp8-configs). Before CUDA is initialised it is "
            "vLLM's function. w8a8_triton_block_scaled_mm looks it up as a module global; no "
            "module holds a copy."
        ),
        upstream="none found (vLLM issue #22619 asks how to provide such files; vLLM PRs "
        "#47732, #52752 add configs for more cards into vLLM's folder)",
        remove_when="vLLM looks block-FP8 configs up by the current device and honours a user "
        "config folder for them",
        factory="vllm_dualgpu.patches.fp8_utils:wrap_get_w8a8_block_fp8_configs",
        params=("N", "K", "block_n", "block_k"),
        issue="#5",
        optional=True,
        upstream_draft=(
            "none yet: needs the device-name follow-up first (configs are looked up by the name "
            "of device 0, cached), then a user config folder for block FP8"
        ),
    ),
    Patch(
        name="sm89-triton-fp8",
        target="vllm.model_executor.kernels.linear:choose_scaled_mm_linear_kernel",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "On SM89 (RTX 40 series, L4, L40) the block-FP8 kernel list "
            "(_POSSIBLE_FP8_BLOCK_KERNELS) reaches MarlinFP8ScaledMMLinearKernel, which expands "
            "weights to 16 bit, before TritonFp8BlockScaledMMKernel, which runs native FP8 "
            "(reference setup, RTX 4070 Ti SUPER: 12-18% faster prefill, +1% per decode step "
            "with tuned configs). When init_fp8_linear_kernel passes that list and the current "
            "device is SM89, the wrapper hands vLLM a copy with Triton moved just ahead of "
            "Marlin; other lists, devices and platforms pass through, so each rank decides by "
            "its own card when its layers are built. VLLM_DUALGPU_SM89_TRITON_FP8=0 keeps "
            "vLLM's order; VLLM_DISABLED_KERNELS and --linear-backend still apply. Called as a "
            "module global; no module holds a copy. The wrapper also names the block-FP8 kernel "
            "each rank took in that rank's summary line: vLLM's \"Selected ...\" line is logged "
            "once for the run (info_once, scope global), the first rank's only."
        ),
        upstream="vLLM PR #40105 put Marlin ahead of Triton in the list; vLLM issue #58241 "
        "(CUTLASS block FP8 excludes SM89); the reference setup's patch cites vLLM PR #59232",
        remove_when="vLLM prefers the Triton block-FP8 kernel over Marlin on SM89",
        factory="vllm_dualgpu.patches.linear_kernels:wrap_choose_scaled_mm_linear_kernel",
        params=("config", "possible_kernels", "compute_capability", "force_kernel", "quantization"),
        issue="#5",
        optional=True,
        upstream_draft=(
            "none yet: upstream chose Marlin first on purpose (vLLM PR #40105); a draft needs "
            "SM89 prefill and decode measurements on vLLM's benchmarks"
        ),
    ),
    _CUTLASS_BLOCK_FP8_PER_RANK,
    replace(
        _CUTLASS_BLOCK_FP8_PER_RANK,
        name="cutlass-block-fp8-per-rank-034",
        vllm_versions=V034,
        why=_CUTLASS_BLOCK_FP8_PER_RANK.why + (
            " vLLM 0.34 changed only the method's refusal message (a missing space), so its source "
            "has its own pin."
        ),
        source_sha256="90b5af6c4e0f080d8016870b843054718d3964613acef11eabf908b0336a276b",
    ),
    # --- speculative decoding under PP (issue #6) ---
    Patch(
        name="pp-inflight-batches",
        target="vllm.config.vllm:VllmConfig.max_concurrent_batches",
        processes=(ENGINE, WORKER),
        vllm_versions=V030_034,
        why=(
            "With async scheduling on the V2 model runner, max_concurrent_batches is "
            "pipeline_parallel_size + 1; with a drafter (MTP) under PP the extra in-flight batch "
            "can keep both GPUs spinning forever. Under the dualgpu executor with PP > 1 the "
            "property returns pipeline_parallel_size, enough to fill every stage. The getter is "
            "patched in EngineCore (batch queue, scheduler) and in workers (V2 runner "
            "concurrency) and decides from the config, so both sides agree."
        ),
        upstream="vLLM issue #53402",
        remove_when="vLLM caps in-flight batches at pipeline_parallel_size under PP with async "
        "scheduling (vLLM #53402 fixed)",
        factory="vllm_dualgpu.patches.config_vllm:wrap_max_concurrent_batches",
        params=("self",),
        issue="#6",
        upstream_draft=(
            "none yet: vLLM issue #53402 is open; a draft needs a GPU run of MTP under PP with "
            "async scheduling to show the spin"
        ),
    ),
    Patch(
        name="drafter-shares-target-embed",
        target="vllm.v1.worker.gpu.spec_decode.eagle.utils:maybe_share_target_embed",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "Under PP, maybe_share_target_embed returns early for drafters that do not declare "
            "has_own_embed_tokens (MTP), so the drafter on the last rank keeps its own copy of "
            "the input embedding although the target holds one on that rank too (+2.4 GiB on "
            "a 27B Qwen3.5). Under the dualgpu executor the drafter shares the target's "
            "embedding whenever it exists on the stage, as vLLM does without PP. A drafter with "
            "its own table (EAGLE3, DFlash) beside a quantized target embedding (no .weight, "
            "where vLLM's comparison raises AttributeError) keeps its own table."
        ),
        upstream="none known (same code in vLLM 0.33)",
        remove_when="vLLM shares the target embedding with the drafter under PP",
        factory="vllm_dualgpu.patches.spec_decode_eagle:wrap_maybe_share_target_embed",
        params=("draft_model", "draft_inner", "target_inner"),
        copies=("vllm.v1.worker.gpu.spec_decode.dflash.utils",),
        issue="#6",
        upstream_draft=(
            "upstream/pp-drafter-shares-target-embed (the quantized target embedding without "
            ".weight is not in it: a separate fix of _should_share)"
        ),
    ),
    Patch(
        name="kv-groups-know-ranks",
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_configs",
        processes=(ENGINE,),
        vllm_versions=V030_032,
        why=(
            "Makes each rank's layers and KV memory known to the grouping below for the "
            "duration of the call (dualgpu with PP > 1 only); the result is vLLM's own."
        ),
        upstream="none",
        remove_when="kv-groups-without-padding goes",
        factory="vllm_dualgpu.patches.kv_cache_utils:wrap_get_kv_cache_configs",
        params=("vllm_config", "kv_cache_specs", "available_memory"),
        copies=("vllm.v1.engine.core",),
        issue="#6",
        upstream_draft=NO_DRAFT_KV_GROUPS,
    ),
    Patch(
        name="kv-groups-know-ranks-033",
        target="vllm.v1.core.kv_cache_planning:get_kv_cache_configs",
        processes=(ENGINE,),
        vllm_versions=V033_034,
        why=(
            "kv-groups-know-ranks for vLLM 0.33, which moved KV planning to kv_cache_planning.py "
            "and groups the model in EngineCore (get_global_kv_cache_groups, v1/engine/core.py:"
            "292) before it measures memory (:310), passing the groups in as a 4th argument "
            "(:321). Under dualgpu with PP > 1 the groups are formed again by vLLM's "
            "get_global_kv_cache_groups with each rank's layers and memory known for the "
            "duration (so the grouping below can choose), and vLLM's planning runs with them."
        ),
        upstream="none",
        remove_when="kv-groups-without-padding-033 goes",
        factory="vllm_dualgpu.patches.kv_cache_utils:wrap_get_kv_cache_configs_global_groups",
        params=("vllm_config", "kv_cache_specs", "available_memory", "global_kv_cache_groups"),
        copies=("vllm.v1.engine.core",),
        issue="#6",
        upstream_draft=NO_DRAFT_KV_GROUPS,
    ),
    Patch(
        name="kv-groups-without-padding",
        target="vllm.v1.core.kv_cache_utils:_get_kv_cache_groups_uniform_page_size",
        processes=(ENGINE,),
        vllm_versions=V030_032,
        why=(
            "vLLM cuts every spec bucket of a hybrid model into groups of the smallest bucket's "
            "size, so a drafter with its own attention spec (5 DFlash layers) pads the target's "
            "16 attention layers to 20 and the drafter's rank pays 5 groups x 5 pages per block "
            "for 13 layers. Under dualgpu with PP > 1 the grouping is chosen among vLLM's and "
            "groupings capping each group's layers per rank, by vLLM's own measure of the KV "
            "memory a max_model_len request needs on the tightest rank, never with more groups "
            "than vLLM's."
        ),
        upstream="none known (the grouping heuristic is the same in vLLM 0.33's "
        "kv_cache_planning.py)",
        remove_when="vLLM groups hybrid KV caches per PP rank without padding",
        factory="vllm_dualgpu.patches.kv_cache_utils:wrap_get_kv_cache_groups_uniform_page_size",
        params=("kv_cache_spec",),
        issue="#6",
        upstream_draft=NO_DRAFT_KV_GROUPS,
    ),
    Patch(
        name="kv-groups-without-padding-033",
        target="vllm.v1.core.kv_cache_planning:_get_kv_cache_groups_uniform_page_size",
        processes=(ENGINE,),
        vllm_versions=V033_034,
        why=(
            "kv-groups-without-padding for vLLM 0.33 (the function moved to "
            "kv_cache_planning.py:416; get_kv_cache_groups still calls it as a module global "
            "when the layout does not pack mixed page sizes block-outermost, "
            "_get_packed_kv_cache_groups). The estimators it measures with take the platform's "
            "KV config builder first there."
        ),
        upstream="none known",
        remove_when="vLLM groups hybrid KV caches per PP rank without padding",
        factory="vllm_dualgpu.patches.kv_cache_utils:wrap_get_kv_cache_groups_uniform_page_size",
        params=("kv_cache_spec",),
        issue="#6",
        upstream_draft=NO_DRAFT_KV_GROUPS,
    ),
    Patch(
        name="kv-drafter-pages-promoted",
        target="vllm.v1.core.kv_cache_utils:unify_kv_cache_spec_page_size",
        processes=(ENGINE,),
        vllm_versions=V030_032,
        why=(
            "A hybrid model's Mamba/GDN and attention pages share one size; a drafter with its "
            "own attention spec has another per-token page, and vLLM only multiplies block "
            "sizes by whole page ratios: a drafter page that does not divide the common page "
            "is padded, and a larger drafter page becomes the common page, padding every Mamba "
            "page and growing the target's attention blocks. Under dualgpu with PP > 1 (with "
            "kv-groups-know-ranks) the drafter's block size becomes common page / per-token "
            "page when that is a multiple of its kernel alignment, so no page is padded; "
            "otherwise a warning names a --block-size that would allow it."
        ),
        upstream="none known",
        remove_when="vLLM sizes drafter blocks to the hybrid model's page",
        factory="vllm_dualgpu.patches.kv_cache_utils:wrap_unify_kv_cache_spec_page_size",
        params=("kv_cache_spec",),
        issue="#6",
        upstream_draft=NO_DRAFT_KV_GROUPS,
    ),
    Patch(
        name="kv-drafter-pages-promoted-033",
        target="vllm.v1.core.kv_cache_planning:unify_kv_cache_spec_page_size",
        processes=(ENGINE,),
        vllm_versions=V033_034,
        why=(
            "kv-drafter-pages-promoted for vLLM 0.33 (the function moved to "
            "kv_cache_planning.py:346 and is called as a module global by get_kv_cache_groups)."
        ),
        upstream="none known",
        remove_when="vLLM sizes drafter blocks to the hybrid model's page",
        factory="vllm_dualgpu.patches.kv_cache_utils:wrap_unify_kv_cache_spec_page_size",
        params=("kv_cache_spec",),
        issue="#6",
        upstream_draft=NO_DRAFT_KV_GROUPS,
    ),
    Patch(
        name="vision-tower-first-rank-only",
        target="vllm.model_executor.models.interfaces:SupportsMultiModal._mark_tower_model",
        processes=(WORKER,),
        vllm_versions=V030_032,
        why=(
            "Multimodal models build and load their vision tower on every PP rank, though with "
            "the V2 model runner only the first rank runs it (later ranks have no encoder "
            "cache or encoder runner). Under dualgpu with PP > 1 and the V2 runner, later "
            "ranks take the weightless StageMissingLayer path vLLM uses for a modality limited "
            "to 0 items, so they hold no vision weights; the first rank is unchanged."
        ),
        upstream="none known (vLLM 0.33 builds the tower on the first rank only with the V2 "
        "runner)",
        remove_when="the supported vLLM builds the vision tower on the first PP rank only",
        factory="vllm_dualgpu.patches.models_interfaces:wrap_mark_tower_model",
        params=("self", "vllm_config", "modalities", "targets"),
        issue="#6",
        fixed_in="0.33.0: SupportsMultiModal._mark_tower_model marks the towers missing on "
        "pipeline stages after the first under Model Runner V2 (models/interfaces.py:346)",
        upstream_draft="none needed: fixed upstream in vLLM 0.33.0",
    ),
    Patch(
        name="hybrid-block-size-every-stage",
        target="vllm.platforms.interface:Platform.update_block_size_for_backend",
        processes=(WORKER,),
        vllm_versions=V030,
        why=(
            "Each worker sizes KV blocks from its own layers and returns early when its stage "
            "holds no non-SSM attention layer, so a stage of only Gated DeltaNet/Mamba layers "
            "keeps 16 tokens while the others raise the block size until an attention page "
            "holds a Mamba state; EngineCore then schedules with the smallest (seen on GPUs: a "
            "1/7 split ran with 16-token blocks where one GPU uses 144). Under dualgpu with PP > 1 such a stage "
            "selects the model's attention backend and runs vLLM's own block-size code with it."
        ),
        upstream="none found (vLLM's even split rarely leaves a stage without attention)",
        remove_when="vLLM aligns the hybrid block size from the whole model on every stage",
        factory="vllm_dualgpu.patches.platforms_interface:wrap_update_block_size_for_backend",
        params=("cls", "vllm_config"),
        issue="#6",
        source_sha256="91c248cdc7443f36b74f3ca3b08b38dd864dcff6cbfac7113bfe8b8bf9b2dd8c",
        upstream_draft=NO_DRAFT_HYBRID_BLOCK,
    ),
    Patch(
        name="hybrid-block-size-every-stage-031",
        target="vllm.platforms.interface:Platform.update_block_size_for_backend",
        processes=(WORKER,),
        vllm_versions=">=0.31.0,<0.32",
        why=(
            "hybrid-block-size-every-stage for vLLM 0.31, whose method asks "
            "_find_non_ssm_backends (a list of the stage's distinct backends, empty on a stage "
            "without attention) and picks a size all of them prefer; the stage without "
            "attention is answered [the model's backend]."
        ),
        upstream="none found",
        remove_when="vLLM aligns the hybrid block size from the whole model on every stage",
        factory="vllm_dualgpu.patches.platforms_interface:wrap_update_block_size_for_backends",
        params=("cls", "vllm_config"),
        issue="#6",
        source_sha256="b7e65a3cbe5862fb146b0f3120afc32310279f73c0463198bdc9fcda23aaecaa",
        upstream_draft=NO_DRAFT_HYBRID_BLOCK,
    ),
    Patch(
        name="hybrid-block-size-every-stage-032",
        target="vllm.platforms.interface:Platform.update_block_size_for_backend",
        processes=(WORKER,),
        vllm_versions=V032_034,
        why=(
            "hybrid-block-size-every-stage-031 for vLLM 0.32 and 0.33 (same source in both), "
            "which also checks the aligned size against every backend "
            "(_check_aligned_block_size) afterwards."
        ),
        upstream="none found",
        remove_when="vLLM aligns the hybrid block size from the whole model on every stage",
        factory="vllm_dualgpu.patches.platforms_interface:wrap_update_block_size_for_backends",
        params=("cls", "vllm_config"),
        issue="#6",
        source_sha256="2176a735a4d8ae41b91c904a605d16f3d9a28b113e299f37a0398f598daa0916",
        upstream_draft=NO_DRAFT_HYBRID_BLOCK,
    ),
    Patch(
        name="dflash-quantized-context-kv-build",
        target="vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._build_context_kv_buffers",
        processes=(WORKER,),
        vllm_versions=V030,
        why=(
            "At load time the DFlash drafter concatenates every layer's raw qkv_proj.weight for "
            "its one-GEMM context K/V projection; a quantized projection has no such tensor "
            "(packed W4A16 holds weight_packed, so loading raises AttributeError; FP8 holds a "
            "weight F.linear cannot use). Under dualgpu, when a projection is quantized, the "
            "build keeps references to the projections instead; unquantized drafters are "
            "built as in vLLM. Inherited by DFlash2 and Qwen3 DSpark drafters; vLLM 0.30's "
            "Gemma4 DSpark and Laguna DFlash drafters override the build (and the projection) "
            "with their own raw-weight code, not covered: a quantized drafter of those fails "
            "as in stock vLLM (static_check lists them; patching/static_allowed.py)."
        ),
        upstream="none known (the reference setup carries its own patch for this crash)",
        remove_when="the supported vLLM projects DFlash context K/V through the layers' quant "
        "methods",
        factory="vllm_dualgpu.patches.qwen3_dflash:wrap_build_context_kv_buffers",
        params=("self", "layers_attn", "has_bias"),
        issue="#6",
        fixed_in="0.31.0: _build_context_kv_buffers keeps the qkv projections and fuses only "
        "unquantized ones (models/qwen3_dflash.py:505)",
        upstream_draft="none needed: fixed upstream in vLLM 0.31.0",
    ),
    Patch(
        name="dflash-quantized-context-kv-project",
        target="vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._project_context_kv",
        processes=(WORKER,),
        vllm_versions=V030,
        why=(
            "Pairs with dflash-quantized-context-kv-build: when that build kept the quantized "
            "projections, each layer's own quant method (the kernel vLLM chose, after its "
            "post-load repacking) projects the normed context and the K/V columns are laid out "
            "as vLLM's fused GEMM lays them out; otherwise vLLM's fused GEMM runs."
        ),
        upstream="none known",
        remove_when="dflash-quantized-context-kv-build goes",
        factory="vllm_dualgpu.patches.qwen3_dflash:wrap_project_context_kv",
        params=("self", "context_states", "num_ctx", "num_layers", "num_kv_heads", "head_dim"),
        issue="#6",
        fixed_in="0.31.0: _project_context_kv runs each quantized projection through its "
        "quant method (models/qwen3_dflash.py:581)",
        upstream_draft="none needed: fixed upstream in vLLM 0.31.0",
    ),
    Patch(
        name="qwen3-next-aux-hidden-relay",
        target="vllm.model_executor.models.qwen3_next:Qwen3NextModel.forward",
        processes=(DEVICE,),  # the model module starts CUDA when imported
        vllm_versions=V030_034,
        why=(
            "EAGLE3 and DFlash drafters read auxiliary hidden states of target layers spread "
            "over every PP stage; Qwen3NextModel.forward (the decoder of Qwen3-Next and, by "
            "inheritance, of every Qwen3.5 model) sends only hidden_states/residual on, so vLLM "
            "refuses these drafters under PP. The replacement is vLLM's forward with the relay "
            "of Qwen2Model.forward added: each stage packs the states it captured into the "
            "IntermediateTensors it sends (pack_local_aux_hidden_states) and the last stage puts "
            "the upstream ones first (collect_remote_aux_hidden_states); the input state is "
            "captured on the first stage only, as in Qwen2. Without PP or auxiliary layers it "
            "computes what vLLM's forward does. Pinned to vLLM's source; the per-instance "
            "declaration is qwen3-next-aux-hidden-flag."
        ),
        upstream="none for this family (vLLM PR #50514 added the relay for Qwen2/Llama; vLLM "
        "PR #45985, open, relays for every EAGLE3 model through forward hooks)",
        remove_when="the supported vLLM relays auxiliary hidden states across PP stages for "
        "Qwen3-Next/Qwen3.5 (Qwen3NextModel declares supports_aux_hidden_states_over_pp)",
        factory="vllm_dualgpu.patches.qwen3_next:wrap_forward",
        params=("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
        issue="#6",
        source_sha256="75c9cf51e414ead3d32d6ffb36698468a6b8821ff02ce1903fcd4f7f49483e61",
        upstream_draft=NO_DRAFT_AUX_RELAY,
    ),
    Patch(
        name="qwen3-next-aux-hidden-flag",
        target="vllm.model_executor.models.interfaces:EagleModelMixin._set_aux_hidden_state_layers",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "vLLM reserves the relay slots (reserve_aux_intermediate_tensor_slots) and accepts "
            "EAGLE3/DFlash under PP (verify_supports_aux_hidden_states_over_pp) only for a "
            "decoder that declares supports_aux_hidden_states_over_pp. After vLLM's method has "
            "set the layers and the PP slot layout, a Qwen3-Next/Qwen3.5 decoder whose class "
            "runs the relaying forward (qwen3-next-aux-hidden-relay) declares it on the "
            "instance, in dualgpu runs only. Every other decoder is left as vLLM made it, so a "
            "skipped forward patch leaves vLLM's refusal in place."
        ),
        upstream="none (see qwen3-next-aux-hidden-relay)",
        remove_when="qwen3-next-aux-hidden-relay goes",
        factory="vllm_dualgpu.patches.models_interfaces:wrap_set_aux_hidden_state_layers",
        params=("self", "layers"),
        issue="#6",
        upstream_draft=NO_DRAFT_AUX_RELAY,
    ),
    Patch(
        name="qwen3-5-aux-hidden-layers",
        target="vllm.model_executor.models.qwen3_5:Qwen3_5ForCausalLMBase.set_aux_hidden_state_layers",
        processes=(DEVICE,),  # the model module starts CUDA when imported
        vllm_versions=V030_034,
        why=(
            "Text-only Qwen3.5 models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) store the "
            "auxiliary layers on the decoder directly, bypassing "
            "EagleModelMixin._set_aux_hidden_state_layers, so the PP slot layout the relay needs "
            "is never computed (Qwen3-Next and the multimodal Qwen3.5 classes go through the "
            "mixin). In dualgpu runs a Qwen3-Next/Qwen3.5 decoder's layers are set through the "
            "mixin (sorted, de-duplicated: the same states are captured). Pinned to vLLM's "
            "source."
        ),
        upstream="none (see qwen3-next-aux-hidden-relay)",
        remove_when="qwen3-next-aux-hidden-relay goes, or Qwen3.5 sets its layers through the "
        "mixin",
        factory="vllm_dualgpu.patches.qwen3_5:wrap_set_aux_hidden_state_layers",
        params=("self", "layers"),
        issue="#6",
        source_sha256="445fa3c254ff474d21e24d3165797d9544be253fe9ae3fb8dca723b27df55c44",
        upstream_draft=NO_DRAFT_AUX_RELAY,
    ),
    Patch(
        name="qwen3-next-embed-quant-config",
        target="vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.__init__",
        processes=(WORKER,),
        vllm_versions=V030_031,
        why=(
            "Qwen3NextModel, Qwen3_5Model and both families' MTP predictors build embed_tokens "
            "without quant_config (Qwen2 and Llama pass it), so a checkpoint with a quantized "
            "embedding (compressed-tensors INT W8A16/W4A16, CompressedTensorsEmbeddingWNA16Int) "
            "fails to load or must keep a dense table (2.4 GiB on a 27B model, on the first "
            "rank). In dualgpu runs an embedding built by one of those four methods without "
            "quant_config gets the model's, with the prefix <prefix>.embed_tokens; every other "
            "caller is unchanged, and the patch falls silent once vLLM passes it."
        ),
        upstream="vLLM issue #54304; vLLM PR #45994 (open) passes quant_config",
        remove_when="vLLM passes quant_config to these embeddings (PR #45994 or equivalent)",
        factory="vllm_dualgpu.patches.vocab_embedding:wrap_vocab_parallel_embedding_init",
        params=(
            "self",
            "num_embeddings",
            "embedding_dim",
            "params_dtype",
            "org_num_embeddings",
            "padding_size",
            "quant_config",
            "prefix",
            "disable_tp",
            "quant_method",
            "parallel_group",
        ),
        issue="#6",
        upstream_draft="none: vLLM PR #45994 (open) is that change",
    ),
    Patch(
        name="qwen3-next-embed-quant-config-032",
        target="vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.__init__",
        processes=(WORKER,),
        vllm_versions=V032_034,
        why=(
            "qwen3-next-embed-quant-config for vLLM 0.32+, whose __init__ adds the keyword-only "
            "reduce_results before quant_method (vocab_parallel_embedding.py:252-266); the "
            "wrapper is the same (quant_config is still positional index 5 and the four "
            "callers still omit it: 0.33 qwen3_next.py:660, qwen3_5.py:251, "
            "qwen3_next_mtp.py:65, qwen3_5_mtp.py:84)."
        ),
        upstream="vLLM issue #54304; vLLM PR #45994 (open) passes quant_config",
        remove_when="vLLM passes quant_config to these embeddings (PR #45994 or equivalent)",
        factory="vllm_dualgpu.patches.vocab_embedding:wrap_vocab_parallel_embedding_init",
        params=(
            "self",
            "num_embeddings",
            "embedding_dim",
            "params_dtype",
            "org_num_embeddings",
            "padding_size",
            "quant_config",
            "prefix",
            "disable_tp",
            "reduce_results",
            "quant_method",
            "parallel_group",
        ),
        issue="#6",
        upstream_draft="none: vLLM PR #45994 (open) is that change",
    ),
    # --- tool-call parser fixes of the reference setup (issue #16 item 5) ---
    # Front end, every executor (tool calls are parsed in the API server), so each names the
    # opt-out VLLM_DUALGPU_TOOL_PARSER_FIXES=0. Bodies: patches/tool_parsers_qwen3_xml.py; what
    # is fixed where: docs/tool-calling.md. Sources read in vLLM 0.30.0, 0.31.0, 0.32.0, 0.33.0
    # and 0.34.0: the flush is the same in all five, 0.34 changed the Qwen3 converter and fast
    # path (the -034 entries); neither fix is upstream.
    Patch(
        name="tool-call-args-closed-when-cut",
        target="vllm.parser.engine.parser_engine:ParserEngine._flush_arg_converter",
        processes=(FRONTEND,),
        vllm_versions=V030_034,
        why=(
            "Streaming sends a string argument as it grows and leaves its closing quote to this "
            "flush at the end of the call, which re-converts the arguments with partial=False: "
            "a parameter still open (max_tokens or a stop string mid-value, or a model that "
            "never wrote `</parameter>`) is dropped, the result no longer extends what was sent, "
            "and the flush sends nothing, so the client's arguments stay unterminated JSON "
            "('{\"path\": \"README.md\", \"content\": \"# Title...'). When vLLM's flush "
            "sends nothing and the streamed text is not valid JSON, the wrapper sends the rest "
            "of the partial conversion (the open value as generated, closed), or else the "
            "closing quote and brackets of what was streamed. Every parser-engine tool parser "
            "with an argument converter (qwen3_xml, qwen3_coder and the others built on "
            "ParserEngine) streams this way. Non-streaming results are unchanged."
        ),
        upstream="vLLM PR #53739 (open): 'Terminate streamed tool arguments the flush cannot "
        "extend'; related vLLM PR #48007 (open), vLLM issue #57699",
        remove_when="the supported vLLM terminates streamed tool arguments that its flush cannot "
        "extend (PR #53739 merged: the pinned source changes and this entry skips)",
        factory="vllm_dualgpu.patches.tool_parsers_qwen3_xml:wrap_flush_arg_converter",
        params=("self", "idx"),
        issue="#16",
        optional=True,
        source_sha256="9abcae3623781596891f89c36fb9bc41eecbab83d29441b88dc0a8ecc3a4e3c1",
        opt_out=TOOL_PARSER_FIXES,
        upstream_draft="none: vLLM PR #53739 (open) is that change",
    ),
    Patch(
        name="qwen3-xml-param-text-in-value",
        target="vllm.parser.qwen3:_qwen3_arg_converter",
        processes=(FRONTEND,),
        vllm_versions=V030_033,
        why=(
            "The Qwen3 XML converter (qwen3_xml, qwen3_coder and every config built by "
            "qwen3_config) ends a value at `</parameter>` or at the next `<parameter=`, so a value "
            "that contains `<parameter=x>` text (a file or prompt about this format) is split "
            "and the rest becomes a phantom argument x. The replacement ends a value only at a "
            "`</parameter>` followed by the next `<parameter=`, `</function>`, `</tool_call>` or "
            "the end of the arguments (while streaming, by the start of one of those too), and converts "
            "as vLLM does otherwise. A model that omits `</parameter>` before the next "
            "`<parameter=` gets the rest in that value instead of a guessed new parameter. "
            "qwen3_config (cached) looks the converter up when it builds a config; the factory "
            "clears its cache. Pinned to vLLM's source."
        ),
        upstream="none found in vLLM (sglang issue #39836 reports the same split in its Qwen3 "
        "coder detector)",
        remove_when="the supported vLLM keeps `<parameter=...>` text inside a Qwen3 XML argument "
        "value",
        factory="vllm_dualgpu.patches.tool_parsers_qwen3_xml:wrap_qwen3_arg_converter",
        params=("raw_args", "partial"),
        issue="#16",
        optional=True,
        source_sha256="9c96f2737147c6245b1c69572a2b6ca25c238b7f8189fc6bceb4b669c2aa4598",
        opt_out=TOOL_PARSER_FIXES,
        upstream_draft=NO_DRAFT_PARSER,
    ),
    Patch(
        name="qwen3-xml-param-text-in-value-streamed",
        target="vllm.parser.qwen3:_qwen3_arg_value_extender",
        processes=(FRONTEND,),
        vllm_versions=V033,
        why=(
            "vLLM 0.33 streams an open Qwen3 XML value through a fast path that skips the "
            "converter and finds the open value with vLLM's rule, so next to "
            "qwen3-xml-param-text-in-value it could stream text for a phantom parameter. The "
            "wrapper hands out vLLM's fast path only where both rules agree on the open "
            "parameter and its text; elsewhere the engine converts each delta, as on "
            "0.30-0.32. The factory clears qwen3_config's cache. Pinned to vLLM's source."
        ),
        upstream="none (the fast path is new in vLLM 0.33; see qwen3-xml-param-text-in-value)",
        remove_when="qwen3-xml-param-text-in-value goes",
        factory="vllm_dualgpu.patches.tool_parsers_qwen3_xml:wrap_qwen3_arg_value_extender",
        params=("raw_args",),
        issue="#16",
        optional=True,
        source_sha256="718f1a582b7ad787d3537bd3dcbe15ebad08962d472ef97d8f1b9177f00ab9f4",
        opt_out=TOOL_PARSER_FIXES,
        upstream_draft=NO_DRAFT_PARSER,
    ),
    Patch(
        name="qwen3-xml-param-text-in-value-034",
        target="vllm.parser.qwen3:_qwen3_arg_converter",
        processes=(FRONTEND,),
        vllm_versions=V034,
        why=(
            "qwen3-xml-param-text-in-value for vLLM 0.34, whose converter still ends a value at "
            "the next `<parameter=` (the same _PARAM_RE, now read through _qwen3_parse_params) "
            "and takes a third argument, closed: a per-parser cache of the parameters closed so "
            "far by that rule, which Qwen3Parser.__init__ binds to the converter and the fast "
            "path when its converter is the module's _qwen3_arg_converter (the replacement, "
            "once patched). The replacement takes closed and leaves it alone (it re-reads the "
            "whole text, as on 0.30-0.33), so the cache holds vLLM's rule only. The factory "
            "clears qwen3_config's cache. Pinned to vLLM's source."
        ),
        upstream="none found in vLLM (sglang issue #39836 reports the same split in its Qwen3 "
        "coder detector)",
        remove_when="the supported vLLM keeps `<parameter=...>` text inside a Qwen3 XML argument "
        "value",
        factory="vllm_dualgpu.patches.tool_parsers_qwen3_xml:wrap_qwen3_arg_converter_034",
        params=("raw_args", "partial", "closed"),
        issue="#16",
        optional=True,
        source_sha256="676aa5418ee9bf992175ac446f5336565eca89819ddb98c550abb3d1ba665158",
        opt_out=TOOL_PARSER_FIXES,
        upstream_draft=NO_DRAFT_PARSER,
    ),
    Patch(
        name="qwen3-xml-param-text-in-value-streamed-034",
        target="vllm.parser.qwen3:_qwen3_arg_value_extender",
        processes=(FRONTEND,),
        vllm_versions=V034,
        why=(
            "qwen3-xml-param-text-in-value-streamed for vLLM 0.34, whose fast path takes the "
            "parser's closed cache and still finds the open value with vLLM's rule (through "
            "_qwen3_parse_params). The wrapper reads vLLM's open parameter through that cache "
            "and hands out vLLM's fast path, with the cache, only where both rules agree on the "
            "open parameter and its text. The factory clears qwen3_config's cache. Pinned to "
            "vLLM's source."
        ),
        upstream="none (see qwen3-xml-param-text-in-value-034)",
        remove_when="qwen3-xml-param-text-in-value-034 goes",
        factory="vllm_dualgpu.patches.tool_parsers_qwen3_xml:wrap_qwen3_arg_value_extender_034",
        params=("raw_args", "closed"),
        issue="#16",
        optional=True,
        source_sha256="c9820f67f7f93420b4f118bdac7b46649bfd6ecb166a07197cb8a5cc7c554d25",
        opt_out=TOOL_PARSER_FIXES,
        upstream_draft=NO_DRAFT_PARSER,
    ),
    # --- serve-time help and errors (issue #17) ---
    Patch(
        name="executor-help",
        target="vllm.engine.arg_utils:EngineArgs.add_cli_args",
        processes=(FRONTEND,),
        vllm_versions=V030_034,
        why=(
            "vllm serve --help=distributed-executor-backend lists the backends vLLM knows and "
            "not 'dualgpu', which only executor-by-name makes a valid value. The wrapper adds "
            "one sentence to that argument's help; parsing is unchanged. Before vLLM builds the "
            "parser (where vLLM without a device fails: 'Failed to infer device type'), a command "
            "line that asks for dualgpu on a machine where NVML sees no GPU is refused in one line "
            "that names vllm-dualgpu doctor (engine/no_gpu.py)."
        ),
        upstream="none (vLLM has no registry of executor names for plugins)",
        remove_when="vLLM lets plugins register executor backends by name (with their help)",
        factory="vllm_dualgpu.patches.arg_utils:wrap_add_cli_args",
        params=("parser",),
        issue="#17",
        optional=True,
        upstream_draft=NO_DRAFT_EXECUTOR_NAME,
    ),
    # --- speed by default (issue #26) ---
    Patch(
        name="flashinfer-xqa-offline",
        target="vllm.utils.flashinfer:supports_trtllm_attention",
        processes=(WORKER,),
        vllm_versions=V030_034,
        why=(
            "supports_trtllm_attention (@cache) answers False unless has_nvidia_artifactory(): "
            "flashinfer-cubin installed (a plain pip install vllm does not install it), "
            "VLLM_HAS_FLASHINFER_CUBIN set, or an HTTP 200 from NVIDIA's artifactory within 5 s. "
            "On SM 9.0 and 12.x it gates only XQA decode, which FlashInfer builds from source by "
            "JIT; offline, the FlashInfer backend verifies speculative tokens as prefills without "
            "a KV split instead (measured on a rank presenting SM 9.0, FP8 hybrid model with MTP, "
            "fp8 KV: 47 ms a step at 64 tokens of context, 227 ms at 250K; with XQA 47.4 / 49.7 / "
            "49.3 ms at 64 / 32K / 250K). When vLLM says False for decode, the artifactory check "
            "failed, the rank's current device is SM 9.0 or 12.x, nvcc and ninja are there for "
            "FlashInfer's JIT (vLLM's has_flashinfer() test) and VLLM_BATCH_INVARIANT is off, the "
            "wrapper answers True, and the rank logs one line saying so; prefill and every other "
            "case are vLLM's answer. can_use_trtllm_attention checks --attention-config "
            "use_trtllm_attention=False before it asks, so the user's False still wins. The same "
            "source in 0.30.0 to 0.34.0 (pinned); the FlashInfer backend holds a copy (rebound), "
            "can_use_trtllm_attention and use_trtllm_attention call the module global."
        ),
        upstream="none found",
        remove_when="vLLM lets SM 9.0 / 12.x use XQA decode without the artifactory check when "
        "FlashInfer can JIT-build it",
        factory="vllm_dualgpu.patches.flashinfer_utils:wrap_supports_trtllm_attention",
        params=("is_prefill",),
        copies=("vllm.v1.attention.backends.flashinfer",),
        issue="#26",
        optional=True,
        source_sha256="418ef3fd21fe7f055305829c299be3c13eec4fb3c8ad9f092ededc2d9b10009e",
        upstream_draft=(
            "none yet: a small change to supports_trtllm_attention (let SM 9.0 / 12.x decode "
            "pass the artifactory check when FlashInfer's JIT can build XQA)"
        ),
    ),
    # --- virtual GPUs: an emulation for tests, applied only where asked (issue #23) ---
    # VLLM_DUALGPU_VIRTUAL_GPUS gives each rank a virtual card on one physical GPU; a worker
    # whose hand-off carries such a card applies these (engine/virtual_card.activate), no
    # other process ever does. docs/virtual-gpus.md.
    *(
        Patch(
            name=name,
            target=target,
            processes=(WORKER,),
            vllm_versions=V030_034,
            why=why,
            upstream="none (an emulation for tests: several cards on one GPU)",
            remove_when="tests of mismatched pairs run on real pairs",
            factory=f"vllm_dualgpu.engine.virtual_card:{factory}",
            params=params,
            issue="#23",
            when=VIRTUAL_GPUS,
            upstream_draft="none: an emulation for tests (several cards on one GPU), not a change vLLM needs",
        )
        for name, target, factory, params, why in (
            ("virtual-gpus-memory-info", "torch.accelerator:get_memory_info", "wrap_memory_info",
             ("device_index",),
             "EMULATION. vLLM's memory snapshot (utils/mem_utils.py MemorySnapshot.measure), its "
             "profile and its CUDA-graph estimates read free and total memory here; on a shared "
             "GPU that is device-wide, so one rank's weights would count as the other rank's "
             "non-torch memory. On a virtual card it answers the card's total, and its free "
             "memory less this process's own use of the GPU (NVML's per-process figure)."),
            ("virtual-gpus-mem-get-info", "torch.cuda:mem_get_info", "wrap_memory_info",
             ("device",),
             "EMULATION. The same for torch.cuda.mem_get_info (the dualgpu worker's own "
             "measurements and vLLM's platform mem_get_info)."),
            ("virtual-gpus-device-name", "vllm.platforms.cuda:NvmlCudaPlatform.get_device_name",
             "wrap_device_name", ("cls", "device_id"),
             "EMULATION. The rank presents as its card: vLLM's tuned-config lookups (block-FP8, "
             "MoE) and logs use this name."),
            ("virtual-gpus-device-name-nonnvml",
             "vllm.platforms.cuda:NonNvmlCudaPlatform.get_device_name", "wrap_device_name",
             ("cls", "device_id"), "EMULATION. As virtual-gpus-device-name, without NVML."),
            ("virtual-gpus-torch-device-name", "torch.cuda:get_device_name",
             "wrap_torch_device_name", ("device",),
             "EMULATION. The card's name for callers that ask torch (this package's rank "
             "summary, some kernels' config lookups)."),
            ("virtual-gpus-capability",
             "vllm.platforms.cuda:NvmlCudaPlatform.get_device_capability",
             "wrap_device_capability", ("cls", "device_id"),
             "EMULATION. The card's capability where the physical GPU can run kernels chosen "
             "for it (not newer than the GPU), so vLLM's Python-side kernel choices are the "
             "card's; torch's own capability (Triton, JIT builds) stays the GPU's."),
            ("virtual-gpus-capability-nonnvml",
             "vllm.platforms.cuda:NonNvmlCudaPlatform.get_device_capability",
             "wrap_device_capability", ("cls", "device_id"),
             "EMULATION. As virtual-gpus-capability, without NVML."),
            ("virtual-gpus-total-memory",
             "vllm.platforms.cuda:NvmlCudaPlatform.get_device_total_memory",
             "wrap_device_total_memory", ("cls", "device_id"),
             "EMULATION. The card's total memory for vLLM's platform queries in the worker."),
        )
    ),
)

def family(name: str) -> str:
    """The problem an entry solves: its name without a release suffix (``-031``)."""
    import re

    return re.sub(r"-0\d\d$", "", name)


def for_version(name: str, version: str) -> Patch | None:
    """The entry of family ``name`` whose range includes vLLM ``version`` (None: not needed or
    not available there)."""
    from vllm_dualgpu.patching.core import version_in_range

    return next((p for p in PATCHES if family(p.name) == name
                 and version_in_range(version, p.vllm_versions)), None)


__all__ = ["ENGINE", "FRONTEND", "PATCHES", "WORKER", "family", "for_version"]
