"""``vllm-dualgpu doctor``: what this machine and the installed vLLM give the plugin to work with.

Prints, briefly: each visible GPU (name, capability, memory, bandwidth class), whether the native
extension loads, which run-time patches would apply to the installed vLLM (a dry run of the
registry: version range, target and parameters; nothing is changed), and which tuned kernel
configs the package ships for each card. Each failed check is followed by a ``fix:`` line with
the command that fixes it. Exit status 1 when the dualgpu path cannot work on this machine (no
NVIDIA driver or GPU, an unsupported vLLM, the extension missing, a required patch that would
not apply), else 0.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

GiB = 1024**3

# Peak memory bandwidth, GB/s: decode speed of a pipeline stage scales with it.
BANDWIDTH_CLASSES = ((2000.0, "very high (HBM)"), (1000.0, "high"), (500.0, "medium"), (0.0, "low"))

_DEVICE_IN_FILE = re.compile(r"device_name=([^,]+?)(?:,|\.json$)")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check the GPUs, the native extension, which patches apply to this vLLM, tuned configs",
    )
    p.set_defaults(run=run)


def bandwidth_class(gbps: float | None) -> str:
    if gbps is None:
        return "bandwidth unknown"
    label = next(name for floor, name in BANDWIDTH_CLASSES if gbps >= floor)
    return f"{gbps:,.0f} GB/s, {label}"


def gpu_lines(read=None) -> tuple[list[str], list]:
    """Lines about each visible GPU, and the GPUs (empty when none or NVML is missing)."""
    if read is None:
        from vllm_dualgpu.nvml import read_visible_gpus as read
    try:
        gpus = read()
    except Exception as exc:  # no driver, no NVML, bad CUDA_VISIBLE_DEVICES
        return [f"GPUs: none visible ({type(exc).__name__}: {exc})".rstrip(), NO_GPU_FIX], []
    if not gpus:
        return ["GPUs: none visible (NVML found no device)", NO_GPU_FIX], []
    lines = ["GPUs (NVML; CUDA_VISIBLE_DEVICES order):"]
    for i, g in enumerate(gpus):
        major, minor = g.capability
        lines.append(
            f"  {i}: {g.name} (GPU {g.physical_id}), sm_{major}{minor} ({major}.{minor}), "
            f"{g.total_bytes / GiB:.1f} GiB total, {g.free_bytes / GiB:.1f} GiB free, "
            f"{bandwidth_class(g.bandwidth_gbps)}"
        )
    lines.append(f"  as plan --gpus local sees them: --gpus {plan_gpus_spec(gpus)!r}")
    return lines, gpus


NO_GPU_FIX = (
    "  fix: the dualgpu executor needs NVIDIA GPUs and their driver (nvidia-smi must list them); "
    "here, plan for other cards with: vllm-dualgpu plan --gpus 'RTX 5090,RTX 4070 Ti SUPER'"
)


def plan_gpus_spec(gpus) -> str:
    """These GPUs in ``--gpus`` syntax, with the reserve the executor keeps free on each: what
    ``plan --gpus local`` plans for, to repeat on another machine."""
    from vllm_dualgpu import envs
    from vllm_dualgpu.nvml import to_gpu_facts

    displays = [g.display for g in gpus]
    try:
        reserves = envs.reserves(os.environ.get(envs.RESERVE), displays)
    except ValueError:
        reserves = [envs.default_reserve(d) for d in displays]
    mib = 1 << 20
    said = {True: ":display=yes", False: ":display=no", None: ""}
    return ",".join(
        f"{f.name}:{f.total_bytes // mib}MiB:{f.free_bytes // mib}MiB:reserve={r.bytes // mib}MiB{said[f.display]}"
        for f, r in zip(to_gpu_facts(gpus), reserves)
    )


def extension_lines() -> tuple[list[str], bool]:
    try:
        import importlib

        ext = importlib.import_module("vllm_dualgpu._C")
    except ImportError as exc:
        return [
            f"Native extension: NOT importable ({exc})",
            "  fix: reinstall with a C++ compiler present (no CUDA toolkit needed): "
            "pip install --force-reinstall --no-deps --no-build-isolation vllm-dualgpu "
            "(from a checkout: pip install --force-reinstall --no-deps --no-build-isolation .)",
        ], False
    hook = "with the sm hook" if hasattr(ext, "plt_hook") else "WITHOUT the sm hook (old build)"
    version = getattr(ext, "__version__", "?")
    return [f"Native extension: vllm_dualgpu._C {version} importable, {hook}"], True


def patch_lines(version: str, patches=None) -> tuple[list[str], list]:
    """One line per registry patch: would it apply to this vLLM (dry run)."""
    from vllm_dualgpu.patching.core import ALREADY, READY, check_patch

    if patches is None:
        from vllm_dualgpu.patching.registry import PATCHES as patches
    lines = [
        f"Run-time patches for vLLM {version} "
        "(dry run; worker patches act only under the dualgpu executor):"
    ]
    outcomes = []
    broken_tv: list[str] = []
    from vllm_dualgpu.patching.core import version_in_range

    others = [p for p in patches if not version_in_range(version, p.vllm_versions)]
    patches = [p for p in patches if version_in_range(version, p.vllm_versions)]
    width = max((len(p.name) for p in patches), default=0)
    for p in patches:
        try:
            out = check_patch(p, version)
            status, reason = out.status, out.reason
        except Exception as exc:  # a target module that fails to import in an unexpected way
            out, status, reason = None, "failed", f"check failed: {type(exc).__name__}: {exc}"
        outcomes.append((p, status))
        if reason and TORCHVISION_BROKEN in reason:
            broken_tv.append(p.name)
            continue
        if reason and TORCHVISION_ABSENT in reason:
            _needs_torchvision.add(p.name)
            reason = "needs torchvision, absent here (fine on a CPU-only machine): " + reason
        word = {READY: "applies", ALREADY: "applied"}.get(status, status)
        where = ",".join(p.processes)
        text = f"  {word:<8} {p.name:<{width}}  [{where}]"
        if reason:
            text += f"  {_one_line(reason)}"
        lines.append(text)
    if others:
        lines.append(f"  ({len(others)} more for other vLLM releases: the support table in docs/patches.md)")
    if broken_tv:
        lines += [
            f"  failed   {len(broken_tv)} patch{'es' if len(broken_tv) != 1 else ''} "
            f"({', '.join(broken_tv)}): importing vLLM's model code fails with 'operator "
            f"{TORCHVISION_BROKEN} does not exist' (torchvision, pulled in by vLLM, needs the CUDA "
            "driver its build was made for)",
            f"  fix: {TORCHVISION_FIX}",
        ]
    return lines, outcomes


TORCHVISION_BROKEN = "torchvision::nms"
TORCHVISION_ABSENT = "No module named 'torchvision'"
# patches whose target module needs torchvision, absent here (filled by patch_lines)
_needs_torchvision: set[str] = set()
TORCHVISION_FIX = (
    "on a machine without an NVIDIA driver, pip uninstall -y torchvision torchaudio torchcodec "
    "(vLLM runs without them; on a GPU machine, reinstall the torchvision build that matches torch)"
)


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_devices(folder: Path) -> Counter:
    """How many config files in ``folder`` name each device (``device_name=...`` in the name)."""
    found: Counter = Counter()
    if folder.is_dir():
        for f in folder.iterdir():
            m = _DEVICE_IN_FILE.search(f.name)
            if m and f.is_file():
                found[m.group(1)] += 1
    return found


def config_lines(gpus, folder: Path | None = None) -> list[str]:
    from vllm_dualgpu.kernels.fp8_configs import device_name_as_file_name, package_config_dir

    folder = package_config_dir() if folder is None else folder
    found = config_devices(folder)
    lines = [f"Tuned kernel configs ({folder}):"]
    cards = {name: device_name_as_file_name(name) for name in dict.fromkeys(g.name for g in gpus)}
    for name, file_name in cards.items():
        n = found.get(file_name, 0)
        missing = "" if n else f" (none named {file_name})"
        lines.append(f"  {name}: {n} file{'s' if n != 1 else ''}{missing}")
    others = {k: v for k, v in found.items() if k not in cards.values()}
    if others:
        listed = ", ".join(f"{k} ({v})" for k, v in sorted(others.items()))
        lines.append(f"  {'also for' if cards else 'for'}: {listed}")
    elif not found:
        lines.append("  none")
    return lines


def report() -> tuple[list[str], int]:
    """The doctor's lines and its exit status."""
    from vllm_dualgpu._version import SUPPORTED_VLLM, __version__
    from vllm_dualgpu.patching.core import SKIPPED, version_in_range

    from vllm_dualgpu import support

    version = support.installed_vllm_version()
    supported = version is not None and version_in_range(version, SUPPORTED_VLLM)
    head = f"vllm-dualgpu {__version__} doctor: vLLM {version or 'not installed'}"
    if not supported:
        head += f" (the plugin supports {SUPPORTED_VLLM} and stays off with this one)"
    lines = [head]
    problems = []
    if not supported:
        from vllm_dualgpu.support import unsupported_reason

        lines.append(f"  fix: {unsupported_reason(version)}")
        problems.append("vLLM")

    more, gpus = gpu_lines()
    lines += more
    if not gpus:
        problems.append("no GPU")
    more, ok = extension_lines()
    lines += more
    if not ok:
        problems.append("extension")
    if version is not None:
        from vllm_dualgpu.kernels.sm_hook import coverage_report

        hook = coverage_report()
        lines.append(f"  {hook}")
        if hook.startswith("sm hook: NOT covered"):
            lines.append("  fix: this vLLM's kernels would dispatch for GPU 0 on every rank; report it "
                         "with the line above (the hook's slots: docs/sm-hook.md)")
            problems.append("sm hook")
        elif "coverage unknown" in hook and "capstone" in hook:
            lines.append("  fix: python -m pip install capstone")
    if version is not None:
        _progress(f"vllm-dualgpu doctor: importing vLLM {version} to check its patch targets (10-40 s) ...")
        more, outcomes = patch_lines(version)
        lines += more
        if supported:
            bad = [p for p, s in outcomes if s in (SKIPPED, "failed") and not p.optional
                   and version_in_range(version, p.vllm_versions)]  # not other releases' entries
            if not gpus:  # without a driver vllm.platforms.cuda (and torchvision) cannot import here
                bad = [p for p in bad if not p.target.startswith("vllm.platforms.cuda:")
                       and p.name not in _needs_torchvision]
            bad = [p.name for p in bad]
            if bad:
                problems.append("patches")
                if not any(line.startswith("  fix:") for line in more):
                    lines.append(
                        f"  fix: {', '.join(bad)} would not apply to this vLLM build: install a "
                        "release the registry was checked against (python -m pip install "
                        "'vllm==0.33.0'), or report the line above"
                    )
        if not gpus:
            lines.append(
                "  (without a CUDA driver, patches of vllm.platforms.cuda cannot be checked here)"
            )
    if version is not None:
        from vllm_dualgpu.patching.interventions import MISSING, doctor_lines

        more, findings = doctor_lines(version)
        lines += more
        if gpus and supported:
            if any(f.status == MISSING for f in findings):
                problems.append("interventions")
    lines += config_lines(gpus)
    if problems:
        lines.append(f"Result: the dualgpu path cannot work here ({', '.join(problems)}): see the fix: lines above")
    else:
        lines.append("Result: ready for --distributed-executor-backend dualgpu")
    return lines, (1 if problems else 0)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args) -> int:
    # Patch checks import vLLM modules; keep their log lines (and transformers' notes about
    # optional image backends, triggered by those imports) out of the report.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    lines, status = report()
    print("\n".join(lines))
    return status
