#!/usr/bin/env python3
"""Which GPU architectures a CUDA library carries code for: the entries of its embedded fat
binaries, by kind (ELF: machine code for one SM; PTX: code the driver compiles on first launch).

    python3 scripts/fatbin_archs.py LIBRARY.so [...]

An SM 9.0 GPU runs an ELF built for sm_90 as shipped; with only sm_80 ELF and PTX (vLLM 0.33's
FlashAttention 2, ``vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so``) its driver compiles each kernel
from the PTX the first time it is launched. ``cuobjdump --list-elf`` says the same where the CUDA
toolkit is installed; this reads the fat binary headers itself (no toolkit on the GPU machine).
"""

from __future__ import annotations

import mmap
import struct
import sys
from collections import Counter

MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "PTX", 2: "ELF"}


def entries(blob) -> Counter:
    """(kind, sm) -> count over every fat binary in ``blob`` (bytes or an mmap).

    A fat binary: magic (u32), version (u16), header size (u16), size of the entries (u64); then
    entries, each a header (kind u16, u16, header size u32, payload size u64, ..., sm u32 at
    offset 28) followed by its payload."""
    found: Counter = Counter()
    pos = 0
    while (i := blob.find(MAGIC, pos)) >= 0:
        _, header, size = struct.unpack_from("<HHQ", blob, i + 4)
        j, end = i + header, i + header + size
        while j + 32 <= min(end, len(blob)):
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", blob, j)
            if kind not in KINDS or entry_header == 0:
                break
            found[(KINDS[kind], struct.unpack_from("<I", blob, j + 28)[0])] += 1
            j += entry_header + payload
        pos = i + 4
    return found


def main(paths: list[str]) -> int:
    if not paths:
        usage = next(line.strip() for line in __doc__.splitlines() if "fatbin_archs.py LIBRARY" in line)
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    for path in paths:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            found = entries(blob)
        text = ", ".join(f"{kind} sm_{sm}: {n}" for (kind, sm), n in sorted(found.items())) or "no fat binary"
        print(f"{path}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
