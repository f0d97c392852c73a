"""scripts/fatbin_archs.py reads the architectures of a library's fat binaries (written here as
bytes the way nvcc lays them out), and runs through the shell."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import fatbin_archs  # noqa: E402


def entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)) + bytes(12) + struct.pack("<I", sm)
    return header.ljust(64, b"\0") + payload


def fatbin(*parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def library() -> bytes:
    # two fat binaries, as FlashAttention 2 in vLLM 0.33's wheel: sm_80 code and sm_80 PTX only
    fa2 = fatbin(entry(2, 80, b"\x7fELF" + bytes(60)), entry(1, 80, b".target sm_80" + bytes(3)))
    return b"junk" * 10 + fa2 + b"more" + fa2


def test_it_counts_each_kind_and_architecture():
    assert fatbin_archs.entries(library()) == {("ELF", 80): 2, ("PTX", 80): 2}
    sm90 = fatbin(entry(2, 90, bytes(32)))
    assert fatbin_archs.entries(sm90) == {("ELF", 90): 1}
    assert not fatbin_archs.entries(b"no fat binary here")


def test_through_the_shell(tmp_path):
    lib = tmp_path / "libfa2.so"
    lib.write_bytes(library())
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fatbin_archs.py"), str(lib)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{lib}: ELF sm_80: 2, PTX sm_80: 2"
    bare = subprocess.run([sys.executable, str(ROOT / "scripts" / "fatbin_archs.py")], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: python3 scripts/fatbin_archs.py LIBRARY.so")
