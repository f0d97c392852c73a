"""Build a ``vllm`` package in which the files a patched source tree changed replace the
installed ones, for running upstream drafts' tests without building vLLM.

``python upstream/overlay.py INSTALLED_VLLM PATCHED_TREE OUT FILE...``: OUT/vllm mirrors
INSTALLED_VLLM (the installed package directory, compiled libraries included) with symbolic
links, and each FILE (a path under ``vllm/`` relative to PATCHED_TREE) is a copy of the patched
one. Only the directories on the way to a patched file are real; every other entry is one link,
so building it takes a few hundred links, not one per file of vLLM.

Without the CUDA driver (no ``libcuda``), the compiled kernel library ``_C_stable_libtorch``
cannot load, and ``vllm.platforms.cuda`` imports it first thing (to register its ops); the
overlay then holds an empty module of that name instead, so that the platform's Python code
can be tested on the CPU with NVML and ``torch.cuda`` stubbed, as vLLM's tests/cuda tests do.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import sys
from pathlib import Path


KERNELS = "_C_stable_libtorch"


def build(installed: Path, patched: Path, out: Path, files: list[str]) -> None:
    rel = [Path(f).relative_to("vllm") for f in files if f.startswith("vllm/")]
    stub_kernels = ctypes.util.find_library("cuda") is None
    dirs = {Path(".")} | {p for f in rel for p in f.parents}
    for d in sorted(dirs, key=lambda p: len(p.parts)):
        target = out / "vllm" / d
        target.mkdir(parents=True, exist_ok=True)
        source = installed / d
        for entry in source.iterdir() if source.is_dir() else ():
            name = d / entry.name
            if name in dirs or name in rel:
                continue
            if stub_kernels and d == Path(".") and entry.name.startswith(KERNELS + "."):
                (target / f"{KERNELS}.py").write_text("# no CUDA driver: empty stand-in\n")
                continue
            os.symlink(entry, target / entry.name)
    for f in rel:
        shutil.copyfile(patched / "vllm" / f, out / "vllm" / f)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: overlay.py INSTALLED_VLLM PATCHED_TREE OUT FILE...")
    build(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
