"""Last step of install.sh on the GPU machine: is the staged vLLM usable, and is anything unmet?

Usage: python3 check_site.py vllm-<release>.txt SITE
Imports torch, vllm and vllm_dualgpu (from SITE, ahead of the image's packages) and prints their
versions, the GPU count, and the NCCL and cuDNN that torch loaded (version and path). Then walks the Requires-Dist of every
distribution in SITE and prints each requirement that neither SITE nor the image meets (the
wheels went in with --no-deps), leaving out what the list's `# not-carried:` lines name.
Exits 1 when an import fails or a module comes from outside SITE; unmet requirements only warn.
"""

import ctypes
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


def not_carried(list_path):
    names = set()
    for line in Path(list_path).read_text().splitlines():
        if line.startswith("# not-carried:"):
            names.update(canonicalize_name(n) for n in line.split(":", 1)[1].split())
    return names


def unmet_requirements(site, skip):
    """Yields (distribution, requirement, what is installed or None) for each unmet one."""
    for dist in md.distributions(path=[site]):
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(req.name) in skip:
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                yield dist.metadata["Name"], str(req), have


def loaded_library(stem):
    """Path of the shared library `stem` this process has mapped, or None."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if f"/{stem}" in line}
    return min(paths) if paths else None


def loaded_nccl():
    """The NCCL that torch loaded: its run-time version and where it came from."""
    path = loaded_library("libnccl.so")
    if path is None:
        return "not loaded"
    code = ctypes.c_int()
    ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
    major, minor, patch = code.value // 10000, code.value // 100 % 100, code.value % 100
    return f"{major}.{minor}.{patch} from {path}"


def main(list_path, site):
    site = str(Path(site).resolve())
    import torch
    import vllm
    import vllm_dualgpu

    outside = [m.__name__ for m in (torch, vllm, vllm_dualgpu) if not m.__file__.startswith(site)]
    if outside:
        sys.exit(f"{', '.join(outside)} imported from outside {site}: source /tmp/gpukit/env.sh first")
    nccl = loaded_nccl()
    try:
        nccl += " (torch built with " + ".".join(map(str, torch.cuda.nccl.version())) + ")"
    except (RuntimeError, AttributeError) as e:
        nccl += f" (torch's NCCL: {e})"
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "n/a"
    except RuntimeError as e:  # torch refuses an older cuDNN minor than it was built with
        cudnn = f"refused ({str(e).splitlines()[0]})"
    print(f"torch {torch.__version__} cuda {torch.version.cuda} gpus {torch.cuda.device_count()}")
    print(f"nccl {nccl}")
    print(f"cudnn {cudnn} from {loaded_library('libcudnn.so')}")
    print(f"vllm {vllm.__version__}, vllm_dualgpu {vllm_dualgpu.__version__}")
    unmet = sorted(set(unmet_requirements(site, not_carried(list_path))))
    for name, req, have in unmet:
        print(f"unmet: {name} requires {req}, found {have or 'nothing'}")
    print(f"{len(unmet)} unmet requirements" + (" (see above; the list may need a wheel)" if unmet else ""))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
