"""Fakes for the sm hook tests: a CUDA runtime and vLLM-like libraries, built here with g++.

The fake runtime is built once per process (:func:`fake_cudart`): the fakes link it by file name,
and a second copy would not be loaded beside the first. (Not a conftest.py fixture: other test
modules import ``conftest`` by name and must find tests/conftest.py.)"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path


# cudaGetDevice answers a per-thread device set by fake_set_device; cudaDeviceGetAttribute answers
# the capability from a table (device 0: 8.9, 1: 12.0, 2: 9.0) and attribute 16
# (cudaDevAttrMultiProcessorCount) as 100 + device, so a test sees which device was asked.
CUDART = r"""
static thread_local int current = 0;
static const int caps[3][2] = {{8, 9}, {12, 0}, {9, 0}};
extern "C" int cudaGetDevice(int* device) { *device = current; return 0; }
extern "C" int cudaDeviceGetAttribute(int* value, int attr, int device) {
    if (device < 0 || device > 2) return 101;  /* cudaErrorInvalidDevice */
    if (attr == 75) { *value = caps[device][0]; return 0; }
    if (attr == 76) { *value = caps[device][1]; return 0; }
    if (attr == 16) { *value = 100 + device; return 0; }
    return 1;
}
extern "C" void fake_set_device(int device) { current = device; }
extern "C" int fake_probe() { return 4242; }
"""


def build(out: Path, name: str, source: str, flags=(), cudart: Path | None = None) -> Path:
    """Compile ``source`` into ``out/name`` (a shared object, -O2), linked to the fake runtime."""
    src = out / f"{name}.cpp"
    src.write_text(source)
    so = out / name
    link = [f"-L{cudart.parent}", "-lfakecudart", f"-Wl,-rpath,{cudart.parent}"] if cudart else []
    subprocess.run(["g++", "-shared", "-fPIC", "-O2", *flags, "-o", str(so), str(src), *link], check=True)
    return so


def on_device(fn, cudart, device: int, *args) -> int:
    """``fn(*args)`` called from a fresh thread whose current (fake) device is ``device``."""
    result = []

    def run():
        cudart.fake_set_device(device)
        result.append(fn(*args))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return result[0]


def load(path) -> ctypes.CDLL:
    """Load a fake like Python loads an extension module (RTLD_NOW, RTLD_LOCAL), with
    RTLD_DEEPBIND so its imports resolve to the fake runtime even when a real libcudart is
    already in the global scope (torch's CUDA build, imported by another test)."""
    return ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_DEEPBIND)


@functools.lru_cache(maxsize=None)
def fake_cudart() -> tuple[Path, ctypes.CDLL]:
    """(path, handle) of libfakecudart.so, built on first use."""
    folder = Path(tempfile.mkdtemp(prefix="fakecudart"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = build(folder, "libfakecudart.so", CUDART)
    return path, ctypes.CDLL(str(path))
