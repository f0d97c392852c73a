"""Every change to vLLM or assumption about it that is not a registry patch, declared and checked.

A :class:`~vllm_dualgpu.patching.core.Patch` replaces a vLLM attribute. The package also rewrites
a native indirection (the sm hook), sets environment variables and config fields that vLLM or a
library it loads reads, swaps the worker class, and calls or reads private vLLM functions and
attributes. Each of those is an :class:`Intervention` here, with the vLLM object it relies on
(``checks``) and what that object must look like: present, taking the expected parameters, and
(for an instance attribute, which exists only on a live object) named in the source of the vLLM
method that sets or reads it. The target is resolved with the patch machinery's own resolution
and parameter check (:func:`~vllm_dualgpu.patching.core.find_target`,
:func:`~vllm_dualgpu.patching.core.params_mismatch`). A dualgpu run checks the entries of its
process at start and stops when one fails (:func:`vllm_dualgpu.plugin.ensure_for_dualgpu`);
``vllm-dualgpu doctor`` lists them (:func:`check_all`); ``docs/patches.md`` shows them.
"""

from __future__ import annotations

import importlib.util
import inspect
import mmap
import os
from dataclasses import dataclass

from vllm_dualgpu.patching.core import _function_of, find_target, params_mismatch, version_in_range
from vllm_dualgpu.process import DEVICE, ENGINE, FRONTEND, WORKER

NATIVE_HOOK, ENVIRONMENT, CONFIG, WORKER_CLASS, PRIVATE_API = (
    "native-hook", "environment", "config", "worker-class", "private-api",
)
KINDS = (NATIVE_HOOK, ENVIRONMENT, CONFIG, WORKER_CLASS, PRIVATE_API)
CLI = "cli"
"""Process of the package's own commands (``tune-fp8``): checked by ``doctor`` only."""

HOLDS, MISSING, NOT_HERE = "holds", "missing", "not here"
"""A check's verdicts: the assumption holds; it does not (the reason says what differs); it
cannot be checked on this machine (a library the intervention is for is not installed)."""

CHECKED = ">=0.30.0,<0.35"
"""Checked against vLLM 0.30.0, 0.33.0 and 0.34.0 (and the releases between, which those bracket)."""
V030_033 = ">=0.30.0,<0.34"
V030 = ">=0.30.0,<0.31"
"""Checked against 0.30.0 only: 0.33.0 differs (the reason is in ``why``)."""
V030_032 = ">=0.30.0,<0.33"
V031_034 = ">=0.31.0,<0.35"
V033_034 = ">=0.33.0,<0.35"
V034 = ">=0.34.0,<0.35"


@dataclass(frozen=True)
class Intervention:
    """One change or assumption outside the patch registry. Every field is in docs/patches.md."""

    name: str
    kind: str
    target: str
    """What is changed or relied on: ``module:Qualified.name`` or an environment variable."""
    processes: tuple[str, ...]
    vllm_versions: str
    """PEP 440 specifier of the vLLM releases this was checked against."""
    why: str
    upstream: str
    remove_when: str
    checks: str = ""
    """``module:Qualified.name`` the check resolves; empty: ``target`` itself."""
    params: tuple[str, ...] | None = None
    """Parameters ``checks`` must take (in order); None: it must only exist."""
    source_names: tuple[str, ...] = ()
    """Names the source of ``checks`` must contain (an instance attribute it sets or reads)."""
    probe: str = ""
    """``module:function`` taking the intervention and returning "" or why it does not hold,
    for what is not a Python attribute (a native symbol, a library's environment variable)."""
    issue: str = ""
    requires: str = ""
    """A package the checked vLLM module needs to import (``ray`` for vLLM's Ray executor):
    where it is not installed the intervention is not applicable (NOT_HERE), not MISSING."""
    upstream_draft: str = ""
    """The ``upstream/`` directory holding a pull request drafted against vLLM that would retire
    this entry, or why there is none (shown in docs/patches.md)."""

    @property
    def check_target(self) -> str:
        return self.checks or self.target


@dataclass
class Finding:
    intervention: Intervention
    status: str
    reason: str = ""

    def short(self) -> str:
        name = self.intervention.name
        return name if not self.reason else f"{name} ({self.reason})"


def check_intervention(item: Intervention, vllm_version: str) -> Finding:
    """Whether ``item``'s assumption holds for the installed vLLM; changes nothing.

    A release outside ``vllm_versions`` is MISSING whatever the check finds; the reason adds
    what it found (what to port, or that the range can widen). A check that raises is a
    MISSING finding with the error: the same at a run's start as in ``doctor``."""
    if item.requires and importlib.util.find_spec(item.requires) is None:
        return Finding(item, NOT_HERE, f"not applicable: {item.requires.capitalize()} not installed")
    try:
        found = _check_target(item)
    except Exception as exc:  # a module that fails to import in an unexpected way
        return Finding(item, MISSING, f"check failed: {type(exc).__name__}: {exc}")
    if not version_in_range(vllm_version, item.vllm_versions):
        seen = found.reason if found.status != HOLDS else "its check passes, so the range may widen"
        return Finding(item, MISSING, f"checked for vLLM {item.vllm_versions}, not {vllm_version} "
                                      f"({seen})")
    return found


def _check_target(item: Intervention) -> Finding:
    if item.probe:
        module, fn = item.probe.split(":", 1)
        status, reason = getattr(importlib.import_module(module), fn)(item)
        return Finding(item, status, reason)
    target = item.check_target
    found = find_target(target)
    if isinstance(found, str):
        return Finding(item, MISSING, found)
    raw = found[2]
    func = _function_of(raw)
    if item.params is not None:
        wrong = params_mismatch(target, func, item.params)
        if wrong:
            return Finding(item, MISSING, wrong)
    if item.source_names:
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError) as exc:
            return Finding(item, MISSING, f"cannot read the source of {target}: {exc}")
        absent = [n for n in item.source_names if n not in source]
        if absent:
            return Finding(item, MISSING, f"{target} no longer uses {', '.join(absent)}")
    return Finding(item, HOLDS)


def for_release(vllm_version: str, items: tuple[Intervention, ...] | None = None) -> tuple[Intervention, ...]:
    """The interventions whose range holds ``vllm_version``."""
    items = INTERVENTIONS if items is None else items
    return tuple(i for i in items if version_in_range(vllm_version, i.vllm_versions))


def check_all(vllm_version: str, kinds: frozenset[str] | None = None,
              items: tuple[Intervention, ...] | None = None) -> list[Finding]:
    """The finding of every intervention for this release (of the processes ``kinds``, when
    given); an entry for other releases (another API of the same assumption) is not this run's."""
    items = for_release(vllm_version, items)
    if kinds is not None:
        items = tuple(i for i in items if kinds.intersection(i.processes))
    return [check_intervention(i, vllm_version) for i in items]


def doctor_lines(vllm_version: str) -> tuple[list[str], list[Finding]]:
    """``vllm-dualgpu doctor``'s section and every finding: one line counting, per kind, the
    interventions that hold, then one line for each that does not (with its reason)."""
    findings = []
    here = for_release(vllm_version)
    for item in here:
        findings.append(check_intervention(item, vllm_version))
    holding = [f.intervention.kind for f in findings if f.status == HOLDS]
    counts = ", ".join(f"{kind} {holding.count(kind)}" for kind in KINDS if kind in holding)
    lines = [
        f"Other interventions for vLLM {vllm_version} (checked at a dualgpu run's start; "
        "docs/patches.md lists them):",
        f"  holds    {len(holding)} of {len(findings)}" + (f" ({counts})" if counts else "")
        + (f"; {len(INTERVENTIONS) - len(here)} more for other vLLM releases" if len(here) < len(INTERVENTIONS) else ""),
    ]
    width = max((len(f.intervention.name) for f in findings if f.status != HOLDS), default=0)
    for f in findings:
        if f.status == HOLDS:
            continue
        item = f.intervention
        text = f"  {f.status:<8} {item.name:<{width}}  [{item.kind}; {','.join(item.processes)}]"
        lines.append(text + (f"  {' '.join(f.reason.split())}" if f.reason else ""))
    return lines, findings


def probe_native_symbol(item: Intervention) -> tuple[str, str]:
    """vLLM ships the library named before the target's colon, and the file names the symbol
    after it (read from the file, not loaded; the hook itself refuses when no PLT slot exists)."""
    library, symbol = item.target.split(":", 1)
    try:
        spec = importlib.util.find_spec(library)
    except (ImportError, ValueError) as exc:
        return MISSING, f"{library} not found: {exc}"
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return MISSING, f"vLLM ships no {library} library"
    with open(spec.origin, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m.find(symbol.encode() + b"\0") < 0:
            return MISSING, f"{os.path.basename(spec.origin)} does not name {symbol}"
    return HOLDS, ""


CUTE_DSL_ENV_FILE = ("base_dsl", "env_manager.py")


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return locations[0] if locations else None


def probe_cute_dsl_arch(item: Intervention) -> tuple[str, str]:
    """The CuTe DSL's base_dsl/env_manager.py reads `{prefix}_ARCH` and has detect_gpu_arch
    (device 0) for when it is unset. Read from the file: importing `cutlass` would read the
    variable before the worker sets it. Not here when the CuTe DSL is not installed."""
    root = _package_dir("cutlass")  # a top-level name: found, not imported
    if root is None:  # not on the path yet: where nvidia-cutlass-dsl's .pth file puts it
        dsl = _package_dir("nvidia_cutlass_dsl")
        root = os.path.join(dsl, "dsl_packages", "cutlass") if dsl else None
    if root is None or not os.path.isdir(root):
        return NOT_HERE, "the CuTe DSL (nvidia-cutlass-dsl) is not installed: nothing to target"
    path = os.path.join(root, *CUTE_DSL_ENV_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        return MISSING, f"the CuTe DSL has no {'/'.join(CUTE_DSL_ENV_FILE)}: {exc}"
    absent = [n for n in ('_ARCH"', "def detect_gpu_arch") if n not in text]
    if absent:
        return MISSING, f"{path} no longer has {', '.join(absent)}"
    return HOLDS, ""


TORCH_ALLOCATOR_LIBRARIES = ("libc10_cuda.so", "libc10.so")
TORCH_ALLOCATOR_NAMES = (b"PYTORCH_CUDA_ALLOC_CONF", b"expandable_segments")


def probe_torch_allocator(item: Intervention) -> tuple[str, str]:
    """torch's CUDA allocator reads ``item.target`` and knows ``expandable_segments``: its
    libraries (read from the files, not loaded) name both. Not here without a CUDA torch."""
    root = _package_dir("torch")
    libs = [os.path.join(root, "lib", n) for n in TORCH_ALLOCATOR_LIBRARIES] if root else []
    libs = [p for p in libs if os.path.isfile(p)]
    if not any(os.path.basename(p) == "libc10_cuda.so" for p in libs):
        return NOT_HERE, "not applicable: this torch has no CUDA allocator (libc10_cuda.so)"
    seen = set()
    for path in libs:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            seen.update(n for n in TORCH_ALLOCATOR_NAMES if m.find(n) >= 0)
    absent = [n.decode() for n in TORCH_ALLOCATOR_NAMES if n not in seen]
    if absent:
        return MISSING, f"torch's allocator libraries no longer name {', '.join(absent)}"
    return HOLDS, ""


def probe_in_file(item: Intervention) -> tuple[str, str]:
    """``item.checks`` read from its module's file instead of imported, for a vLLM module that
    does not import on every machine (vLLM's FlashInfer backend asserts CUDA at import, so on a
    CPU-only torch the import fails where the file is as expected): the method with ``params``,
    its source naming every ``source_names`` entry."""
    from vllm_dualgpu.patching.source_check import check_in_file

    why = check_in_file(item.checks, item.params or (), names=item.source_names)
    return (MISSING, why) if why else (HOLDS, "")


_KV = "vllm.v1.core.kv_cache_utils"
_KV_PLANNING = "vllm.v1.core.kv_cache_planning"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_NO_HOOK = "none (vLLM has no extension point for this)"

INTERVENTIONS: tuple[Intervention, ...] = (
    Intervention(
        name="vllm-logging-bootstrap",
        kind=PRIVATE_API,
        target="vllm.logger:_configure_vllm_root_logger",
        processes=(FRONTEND, ENGINE, WORKER),
        vllm_versions=CHECKED,
        why=(
            "vLLM 0.33 configures its logger only once a CLI or engine starts, after plugins "
            "load, so the plugin's one line per process was dropped there. When vLLM's logger "
            "has no handler yet, the plugin applies vLLM's own bootstrap configuration (what "
            "vLLM 0.30-0.32 do on import; log.ensure_vllm_logging); vLLM's later "
            "configuration replaces it."
        ),
        upstream="none (vLLM configures logging per LoggingConfig since 0.33)",
        remove_when="the plugin logs through a hook vLLM calls once logging is configured",
        issue="#16",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    # --- native hook ---
    Intervention(
        name="sm-hook-got",
        kind=NATIVE_HOOK,
        target="vllm._C_stable_libtorch:_Z18get_sm_version_numv",
        processes=(DEVICE,),
        vllm_versions=CHECKED,
        why=(
            "vLLM's compiled library picks CUTLASS/FP4/MoE kernels by get_sm_version_num(), "
            "which answers for device 0 in every process; the worker points the library's PLT "
            "slot(s) for it at a per-current-device function (kernels/sm_hook.py, "
            "docs/sm-hook.md)."
        ),
        upstream="none (the same device-0 answer is reported in the 1CatAI/1Cat-vLLM fork, "
        "issue #412)",
        remove_when="vLLM's get_sm_version_num() answers for the current device",
        probe="vllm_dualgpu.patching.interventions:probe_native_symbol",
        issue="#4",
        upstream_draft=(
            "upstream/per-device-capability (its csrc/cutlass_extensions/common.hpp change; "
            "vLLM's library must be rebuilt)"
        ),
    ),
    # --- environment ---
    Intervention(
        name="cute-dsl-arch",
        kind=ENVIRONMENT,
        target="CUTE_DSL_ARCH",
        processes=(DEVICE,),
        vllm_versions=CHECKED,
        why=(
            "The CuTe DSL (FlashInfer's and vLLM's CuTe-DSL kernels) compiles for CUTE_DSL_ARCH, "
            "else for CUDA device 0's capability; each worker sets it to its own device's "
            "target unless the user set it (kernels/flashinfer.py)."
        ),
        upstream=_NO_HOOK,
        remove_when="the CuTe DSL detects the current device instead of device 0",
        probe="vllm_dualgpu.patching.interventions:probe_cute_dsl_arch",
        issue="#4",
        upstream_draft="none: the CuTe DSL is NVIDIA's library, not vLLM",
    ),
    Intervention(
        name="cuda-device-order",
        kind=ENVIRONMENT,
        target="CUDA_DEVICE_ORDER",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The executor sets CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers GPUs as NVML does "
            "(the plan reads NVML); vLLM maps a device id through CUDA_VISIBLE_DEVICES (its "
            "platform's device_control_env_var) in that numbering."
        ),
        upstream=_NO_HOOK,
        remove_when="never while the plan reads the GPUs through NVML",
        checks="vllm.platforms.interface:Platform.device_id_to_physical_device_id",
        params=("cls", "device_id"),
        source_names=("device_control_env_var",),
        issue="#2",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="pp-layer-partition",
        kind=ENVIRONMENT,
        target="VLLM_PP_LAYER_PARTITION",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The executor writes the planned layer split (unless the user set one); vLLM's "
            "get_pp_indices reads it in every worker."
        ),
        upstream=_NO_HOOK,
        remove_when="vLLM takes a layer split in its config",
        checks="vllm.distributed.utils:get_pp_indices",
        params=("num_hidden_layers", "pp_rank", "pp_size"),
        source_names=("VLLM_PP_LAYER_PARTITION",),
        issue="#2",
        upstream_draft="upstream/pipeline-layer-partition",
    ),
    Intervention(
        name="flashinfer-workspace-size",
        kind=ENVIRONMENT,
        target="VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "Where a rank runs FlashInfer and the user did not set it, the executor sets the plan's "
            "size (97 MiB for the reference shape instead of vLLM's 394): twice what FlashInfer 0.7's "
            "split-KV plans can take on a card of up to 192 SMs (planner/memory.py "
            "plugin_flashinfer_workspace); vLLM still grows the buffer to its own estimate for the "
            "batch. The workers inherit it (envs.export_flashinfer_workspace)."
        ),
        upstream=(
            "vLLM PR #40383 (open): size the workspace from the model and batch instead of a fixed "
            "default"
        ),
        remove_when="vLLM sizes FlashInfer's workspace from the model, the batch and the card",
        checks="vllm.v1.attention.backends.flashinfer:FlashInferMetadataBuilder._get_workspace_buffer",
        params=("self",),
        source_names=("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "max_num_batched_tokens",
                      "FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM"),
        probe="vllm_dualgpu.patching.interventions:probe_in_file",  # the module asserts CUDA at import
        issue="#28",
        upstream_draft="none: vLLM PR #40383 is the upstream change",
    ),
    Intervention(
        name="expandable-segments",
        kind=ENVIRONMENT,
        target="PYTORCH_CUDA_ALLOC_CONF",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "Unless the user configured torch's allocator (PYTORCH_CUDA_ALLOC_CONF or "
            "PYTORCH_ALLOC_CONF) or the run needs fixed segments (tensor parallelism with vLLM's "
            "custom all-reduce, sleep mode, a KV connector), the multiprocess executor runs its "
            "workers with expandable_segments:True, as the reference launchers do: without it a "
            "pass of other tensor sizes than the last (a 4 MP image after a 250K prompt) took 632 "
            "MiB of new segments for 256 MiB more allocated on the virtual pair's small card and "
            "ran it into its reserve (envs.allocator_choice; `plan` says the same)."
        ),
        upstream="none (torch's setting; vLLM leaves it to the user)",
        remove_when="vLLM chooses torch's allocator settings itself",
        probe="vllm_dualgpu.patching.interventions:probe_torch_allocator",
        issue="#28",
        upstream_draft="none: a torch setting the user may also set; nothing in vLLM to change",
    ),
    # --- config ---
    Intervention(
        name="assigned-physical-gpu-ids",
        kind=CONFIG,
        target="vllm.config.parallel:ParallelConfig.assigned_physical_gpu_ids",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The executor gives each pipeline rank its GPU (the card with the most memory last); "
            "vLLM's worker process installs the list before it picks its device."
        ),
        upstream=_NO_HOOK,
        remove_when="never (this is vLLM's own field; the check pins where vLLM reads it)",
        checks="vllm.v1.executor.multiproc_executor:WorkerProc.worker_main",
        source_names=("assigned_physical_gpu_ids", "set_assigned_physical_gpu_ids"),
        issue="#2",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    # --- dualgpu-ray (docs/multi-node.md) ---
    Intervention(
        name="ray-bundle-indices",
        kind=ENVIRONMENT,
        target="VLLM_RAY_BUNDLE_INDICES",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The dualgpu-ray executor gives each rank a placement-group bundle on its planned "
            "node; RayExecutorV2 reads the list instead of sorting bundles driver node first, and "
            "gives every worker of a node that node's GPU ids sorted with its place among them."
        ),
        upstream=_NO_HOOK,
        remove_when="vLLM takes a rank-to-node order in its config",
        checks="vllm.v1.executor.ray_executor_v2:RayExecutorV2._init_executor",
        source_names=("VLLM_RAY_BUNDLE_INDICES", "get_bundles_for_indices", "node_workers[node_id].index(i)",
                      "sorted(node_physical_gpu_ids[node_id])"),
        issue="#20",
        requires="ray",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="ray-placement-group-reused",
        kind=PRIVATE_API,
        target="vllm.v1.executor.ray_utils:initialize_ray_cluster",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The dualgpu-ray executor gathers the nodes' facts, then creates vLLM's own placement "
            "group through this function before RayExecutorV2 runs; called again there, it reuses "
            "the group it finds in the config."
        ),
        upstream=_NO_HOOK,
        remove_when="vLLM lets an executor plan between connecting to Ray and placing workers",
        source_names=("parallel_config.placement_group",),
        issue="#20",
        requires="ray",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="ray-node-gpu-order",
        kind=CONFIG,
        target="vllm.config.parallel:ParallelConfig.assigned_physical_gpu_ids",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "In a dualgpu-ray worker, the node's GPU ids in planned rank order replace the sorted "
            "list RayExecutorV2 passed (same ids), before vLLM's worker installs it and takes the "
            "entry of its local rank."
        ),
        upstream=_NO_HOOK,
        remove_when="never (this is vLLM's own field; the check pins where vLLM reads it)",
        checks=f"{_WORKER}.init_device",
        source_names=("assigned_physical_gpu_ids", "set_assigned_physical_gpu_ids"),
        issue="#20",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="ray-worker-backend-name",
        kind=CONFIG,
        target="vllm.config.parallel:ParallelConfig.distributed_executor_backend",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "A dualgpu-ray worker names its backend 'ray' in its own copy of the config: vLLM's "
            "worker tests that name, not uses_ray, to skip its one-host check local_world_size <= "
            "len(assigned_physical_gpu_ids), which a layout across nodes fails."
        ),
        upstream="none (vLLM tests the backend's name where uses_ray would cover executor subclasses)",
        remove_when="vLLM's worker asks parallel_config.use_ray there",
        checks=f"{_WORKER}.init_device",
        source_names=('"ray"', "local_world_size"),
        issue="#20",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="flashinfer-autotune-off",
        kind=CONFIG,
        target="vllm.config.kernel:KernelConfig.enable_flashinfer_autotune",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "With more than one pipeline stage (or mixed capabilities) the executor turns "
            "FlashInfer autotune off: vLLM averages its timings over the world group while each "
            "stage tunes different ops, and the boot hangs (kernels/flashinfer.py). Set before the "
            "workers spawn, read (and checked) in each worker's kernel warm-up."
        ),
        upstream="vLLM issue #52291; vLLM PR #57198 (not merged) tunes per stage group",
        remove_when="vLLM autotunes per pipeline stage (PR #57198 or equivalent)",
        checks="vllm.model_executor.warmup.kernel_warmup:kernel_warmup",
        source_names=("enable_flashinfer_autotune",),
        issue="#5",
        upstream_draft="none: vLLM PR #57198 (open) tunes per pipeline stage group",
    ),
    Intervention(
        name="gpu-memory-utilization-floor",
        kind=CONFIG,
        target="vllm.config.cache:CacheConfig.gpu_memory_utilization",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "vLLM refuses to boot when a card has less free than utilization x total. The "
            "dualgpu worker sets 1e-6 before Worker.init_device, so that check passes, then sets "
            "its own budget (free minus the reserve) as requested_memory."
        ),
        upstream="none (vLLM sizes every rank by one utilization share)",
        remove_when="vLLM takes a per-rank memory budget",
        checks="vllm.v1.worker.utils:request_memory",
        source_names=("gpu_memory_utilization", "free_memory"),
        issue="#3",
        upstream_draft="upstream/per-rank-memory-reserve",
    ),
    # --- worker class ---
    Intervention(
        name="worker-class",
        kind=WORKER_CLASS,
        target="vllm.config.parallel:ParallelConfig.worker_cls",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "The executor replaces vLLM's GPU worker (vllm.v1.worker.gpu_worker.Worker) with "
            "DualGpuWorker, a subclass that gives each rank its own memory budget and logs one "
            "summary line; any other worker_cls is left alone. Checked where the class is built."
        ),
        upstream=_NO_HOOK,
        remove_when="vLLM takes a per-rank memory budget",
        checks=_WORKER,
        issue="#3",
        upstream_draft="upstream/per-rank-memory-reserve",
    ),
    *(
        Intervention(
            name=f"worker-overrides-{method.replace('_', '-')}",
            kind=WORKER_CLASS,
            target=f"{_WORKER}.{method}",
            processes=(WORKER,),
            vllm_versions=versions,
            why=f"DualGpuWorker overrides {method} and calls vLLM's with these parameters." + extra,
            upstream=_NO_HOOK,
            remove_when="the worker class goes (see worker-class)",
            params=params,
            issue="#3",
            upstream_draft="upstream/per-rank-memory-reserve",
        )
        for method, params, versions, extra in (
            ("init_device", ("self",), CHECKED, ""),
            ("determine_available_memory", ("self",), CHECKED, ""),
            ("compile_or_warm_up_model", ("self",), CHECKED, ""),
            ("initialize_from_config", ("self", "kv_cache_config"), CHECKED, ""),
            # vLLM 0.34's extensible KV cache, sized from memory measured after warm-up, is on by
            # default on CUDA; its engine asks every worker this before it profiles
            # (EngineCore._initialize_kv_caches) and, given a reason, turns it off everywhere.
            ("extensible_kv_cache_unsupported_reason", ("self",), V034,
             " It returns why the dualgpu worker sizes the KV cache by vLLM's profile (the plan's "
             "model), so vLLM turns its extensible KV cache off on every rank with a warning."),
            ("disable_extensible_kv_cache", ("self",), V034,
             " vLLM's recomputes requested_memory from the start snapshot; the override keeps the "
             "rank's budget."),
        )
    ),
    Intervention(
        name="engine-asks-extensible-kv-cache",
        kind=PRIVATE_API,
        target=f"{_WORKER}.extensible_kv_cache_unsupported_reason",
        processes=(ENGINE,),
        vllm_versions=V034,
        why=(
            "vLLM 0.34 sizes the KV cache from memory measured after warm-up and graph capture "
            "(the extensible KV cache, on by default on CUDA) unless a worker says it cannot: "
            "its engine asks every worker before it profiles and then turns the feature off on "
            "all of them, with a warning that names the reason. DualGpuWorker answers, so each "
            "rank's pool comes from its budget through vLLM's profile, as the plan predicts."
        ),
        upstream=_NO_HOOK,
        remove_when="the planner models the extensible KV cache's measured sizing per rank",
        checks="vllm.v1.engine.core:EngineCore._initialize_kv_caches",
        source_names=("extensible_kv_cache_unsupported_reason", "disable_extensible_kv_cache"),
        issue="#3",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    # --- private vLLM attributes the worker sets or reads ---
    Intervention(
        name="worker-init-snapshot",
        kind=PRIVATE_API,
        target=f"{_WORKER}.init_snapshot",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why="DualGpuWorker reads the free memory vLLM's init_device snapshot saw.",
        upstream=_NO_HOOK,
        remove_when="the worker class goes (see worker-class)",
        checks=f"{_WORKER}.init_device",
        source_names=("self.init_snapshot",),
        issue="#3",
        upstream_draft="upstream/per-rank-memory-reserve",
    ),
    Intervention(
        name="worker-requested-memory",
        kind=PRIVATE_API,
        target=f"{_WORKER}.requested_memory",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "DualGpuWorker overwrites the budget vLLM's init_device computed; vLLM sizes the KV "
            "cache from it in determine_available_memory."
        ),
        upstream=_NO_HOOK,
        remove_when="the worker class goes (see worker-class)",
        checks=f"{_WORKER}.determine_available_memory",
        source_names=("self.requested_memory",),
        issue="#3",
        upstream_draft="upstream/per-rank-memory-reserve",
    ),
    *(
        Intervention(
            name=f"model-memory-usage{suffix}",
            kind=PRIVATE_API,
            target=f"{module}:GPUModelRunner.model_memory_usage",
            processes=(DEVICE,),
            vllm_versions=versions,
            why=f"The rank summary line reports the weights' size the {runner} runner measured.",
            upstream=_NO_HOOK,
            remove_when="never (a report only; the check keeps it honest)",
            checks=f"{module}:GPUModelRunner.load_model",
            source_names=("self.model_memory_usage",),
            issue="#3",
            upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
        )
        for suffix, runner, module, versions in (
            # vLLM 0.34 removed the v1 runner's module: the v2 runner is the only one
            ("", "v1", "vllm.v1.worker.gpu_model_runner", V030_033),
            ("-v2", "v2", "vllm.v1.worker.gpu.model_runner", CHECKED),
        )
    ),
    Intervention(
        name="pp-handler-broadcast-group",
        kind=PRIVATE_API,
        target="vllm.v1.worker.gpu.pp_utils:PPHandler.broadcast_group",
        processes=(DEVICE,),
        vllm_versions=CHECKED,
        why=(
            "Before profiling, DualGpuWorker makes NCCL allocate the v2 runner's sampled-token "
            "broadcast (model_runner.pp_handler.broadcast_group), so its buffers are counted "
            "before the KV pool takes the budget."
        ),
        upstream=_NO_HOOK,
        remove_when="vLLM creates its pipeline communicators before profiling",
        checks="vllm.v1.worker.gpu.pp_utils:PPHandler.__init__",
        source_names=("self.broadcast_group",),
        issue="#3",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    # --- private vLLM functions: the context check and the KV grouping patch ---
    *(
        Intervention(
            name=f"kv-{fn.strip('_').replace('_', '-')}{suffix}",
            kind=PRIVATE_API,
            target=f"{module}:{fn}",
            processes=(ENGINE,),
            vllm_versions=versions,
            why=why + (" vLLM 0.33 moved it to vllm.v1.core.kv_cache_planning." if not suffix else
                       " Its vLLM 0.33 home (kv_cache_planning), with the builder argument 0.33 "
                       "added (patches/kv_cache_utils.py passes it)."),
            upstream=_NO_HOOK,
            remove_when="vLLM reports the largest context every rank fits (vLLM issue #34076) "
            "and groups KV layers per rank",
            params=params,
            issue="#3",
            upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
        )
        for module, versions, suffix, fn, params, why in (
            (_KV, V030_032, "", "_project_kv_cache_groups_to_worker", ("global_kv_cache_groups", "worker_spec"),
             "engine/context_fit.py, engine/kv_pricing.py and the KV grouping patch project the "
             "model's KV groups onto each rank with it."),
            (_KV, V030_032, "", "_pool_bytes_per_block", None,
             "engine/context_fit.py takes the null block off each rank's budget with it (its "
             "parameters are (kv_cache_groups) before vLLM 0.32, (vllm_config, kv_cache_groups) "
             "from 0.32: patches/kv_cache_utils.py asks which)."),
            (_KV, V030_032, "", "_estimate_max_model_len_from_groups",
             ("vllm_config", "kv_cache_groups", "available_memory"),
             "engine/context_fit.py and engine/kv_pricing.py ask vLLM's own estimate of each "
             "rank's longest request."),
            (_KV, V030_032, "", "_max_memory_usage_bytes_from_groups", ("vllm_config", "kv_cache_groups"),
             "The KV grouping patch (kv-groups-without-padding) prices a grouping with it."),
            (_KV_PLANNING, V033_034, "-033", "_project_kv_cache_groups_to_worker",
             ("global_kv_cache_groups", "worker_spec"),
             "engine/context_fit.py, engine/kv_pricing.py and the KV grouping patch project the "
             "model's KV groups onto each rank with it."),
            (_KV_PLANNING, V033_034, "-033", "_pool_bytes_per_block_from_builder",
             ("builder", "vllm_config", "kv_cache_groups"),
             "engine/context_fit.py takes the null block off each rank's budget with it."),
            (_KV_PLANNING, V033_034, "-033", "_estimate_max_model_len_from_groups",
             ("builder", "vllm_config", "kv_cache_groups", "available_memory"),
             "engine/context_fit.py and engine/kv_pricing.py ask vLLM's own estimate of each "
             "rank's longest request."),
            (_KV_PLANNING, V033_034, "-033", "_max_memory_usage_bytes_from_groups",
             ("builder", "vllm_config", "kv_cache_groups"),
             "The KV grouping patch (kv-groups-without-padding-033) prices a grouping with it."),
        )
    ),
    # --- vLLM config attributes read through getattr (with a default that hides a rename) ---
    Intervention(
        name="kv-pricing-layout",
        kind=CONFIG,
        target="vllm.config.cache:CacheConfig.kv_cache_layout",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The executor prices its plan's KV cache with vLLM's grouping before the workers "
            "exist (engine/kv_pricing.py); EngineCore resolves the layout only once they report "
            "their backends, and vLLM's grouping reads it. While pricing, an unresolved layout "
            "is set to LBNHC (the layout the planner assumes) and set back to None after."
        ),
        upstream=_NO_HOOK,
        remove_when="never (vLLM's own field; the check pins the name)",
        issue="#15",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="user-specified-block-size",
        kind=PRIVATE_API,
        target="vllm.config.cache:CacheConfig.user_specified_block_size",
        processes=(ENGINE,),
        vllm_versions=CHECKED,
        why=(
            "The plan takes --block-size as the user's only when vLLM says the user set it "
            "(engine/planning.py), and the drafter-page patch words its advice by it."
        ),
        upstream=_NO_HOOK,
        remove_when="never (vLLM's own field; the check pins its name)",
        issue="#3",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="is-mm-prefix-lm",
        kind=PRIVATE_API,
        target="vllm.config.model:ModelConfig.is_mm_prefix_lm",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "The hybrid block-size patch selects the model's attention backend with the "
            "arguments Attention passes, this one among them (patches/platforms_interface.py)."
        ),
        upstream=_NO_HOOK,
        remove_when="the hybrid-block-size-every-stage patch goes",
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    # --- private vLLM names the patch bodies use ---
    Intervention(
        name="find-non-ssm-backend",
        kind=PRIVATE_API,
        target="vllm.platforms.interface:Platform._find_non_ssm_backend",
        processes=(WORKER,),
        vllm_versions=V030,
        why=(
            "The hybrid block-size patch asks whether a stage holds a non-SSM attention layer "
            "(patches/platforms_interface.py) and stands in its answer. vLLM 0.33 renamed it "
            "_find_non_ssm_backends."
        ),
        upstream=_NO_HOOK,
        remove_when="the hybrid-block-size-every-stage patch goes",
        params=("cls", "vllm_config"),
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="find-non-ssm-backends",
        kind=PRIVATE_API,
        target="vllm.platforms.interface:Platform._find_non_ssm_backends",
        processes=(WORKER,),
        vllm_versions=V031_034,
        why=(
            "find-non-ssm-backend under its vLLM 0.31+ name: a list of the stage's distinct "
            "non-SSM attention backends, empty for none (patches/platforms_interface.py)."
        ),
        upstream=_NO_HOOK,
        remove_when="the hybrid-block-size-every-stage patch goes",
        params=("cls", "vllm_config"),
        issue="#16",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="possible-fp8-block-kernels",
        kind=PRIVATE_API,
        target="vllm.model_executor.kernels.linear:_POSSIBLE_FP8_BLOCK_KERNELS",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "The SM89 block-FP8 preference patch reorders only the calls that pass this list "
            "(patches/linear_kernels.py)."
        ),
        upstream=_NO_HOOK,
        remove_when="the sm89-triton-fp8 patch goes",
        issue="#5",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="w8a8-triton-block-scaled-mm",
        kind=PRIVATE_API,
        target="vllm.model_executor.layers.quantization.utils.fp8_utils:_w8a8_triton_block_scaled_mm",
        processes=(CLI,),
        vllm_versions=CHECKED,
        why="vllm-dualgpu tune-fp8 times vLLM's own block-FP8 Triton kernel (kernels/fp8_tuner.py).",
        upstream=_NO_HOOK,
        remove_when="vLLM ships a tuner for this kernel on every card",
        issue="#5",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="maybe-add-hidden-state",
        kind=PRIVATE_API,
        target="vllm.model_executor.models.interfaces:EagleModelMixin._maybe_add_hidden_state",
        processes=(DEVICE,),
        vllm_versions=CHECKED,
        why="The Qwen3-Next relay forward (patches/qwen3_next.py) captures auxiliary states with it.",
        upstream=_NO_HOOK,
        remove_when="the qwen3-next-aux-hidden-relay patch goes",
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="tower-model-names",
        kind=PRIVATE_API,
        target="vllm.model_executor.models.interfaces:SupportsMultiModal._tower_model_names",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why="The vision-tower patch (patches/models_interfaces.py) sets the names vLLM reads here.",
        upstream=_NO_HOOK,
        remove_when="the vision-tower-first-rank-only patch goes",
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="dflash-rms-norm-eps",
        kind=PRIVATE_API,
        target="vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._rms_norm_eps",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "The quantized DFlash context-KV patch (patches/qwen3_dflash.py) reads the epsilon "
            "vLLM sets in _build_fused_kv_buffers, around the _build_context_kv_buffers call "
            "that patch replaces."
        ),
        upstream=_NO_HOOK,
        remove_when="the dflash-quantized-context-kv-* patches go",
        checks="vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._build_fused_kv_buffers",
        source_names=("self._rms_norm_eps =", "self._build_context_kv_buffers("),
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="custom-ops-rms-norm",
        kind=PRIVATE_API,
        target="vllm._custom_ops:rms_norm",
        processes=(DEVICE,),
        vllm_versions=CHECKED,
        why="The quantized DFlash context-KV patch normalises with vLLM's fused op.",
        upstream=_NO_HOOK,
        remove_when="the dflash-quantized-context-kv-* patches go",
        params=("out", "input", "weight", "epsilon"),
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
    Intervention(
        name="has-own-embed-tokens",
        kind=PRIVATE_API,
        target="vllm.v1.worker.gpu.spec_decode.eagle.utils:maybe_share_target_embed",
        processes=(WORKER,),
        vllm_versions=CHECKED,
        why=(
            "The drafter-embedding patch reads has_own_embed_tokens off the drafter and follows "
            "vLLM's _should_share (patches/spec_decode_eagle.py)."
        ),
        upstream=_NO_HOOK,
        remove_when="the drafter-shares-target-embed patch goes",
        source_names=("has_own_embed_tokens", "_should_share"),
        issue="#6",
        upstream_draft="none: a reliance on what vLLM already has; it goes with the entries that use it",
    ),
)
