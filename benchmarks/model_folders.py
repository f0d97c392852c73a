"""Where the benchmarks keep the model folders they write: one root for every OUTDIR (``--models``),
one folder per content.

vLLM 0.33 hashes the model's path into its compile-cache key (``ModelConfig.compute_hash``), the
drafter's too, so a model folder written fresh under each OUTDIR made every run into a new OUTDIR
compile its graphs again. headline.py, soak.py and memory_sweep.py import this module.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def default_models_dir() -> Path:
    """--models' default: one folder of the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``)
    for every OUTDIR (named for headline.py, its first user: the folders already there, and the
    compiled graphs keyed by their paths, stay in use)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-dualgpu" / "headline-models"


def add_models_option(ap: argparse.ArgumentParser) -> None:
    """``--models DIR``, defaulting to :func:`default_models_dir`."""
    ap.add_argument("--models", type=Path, default=default_models_dir(), metavar="DIR",
                    help="the model folders' root, one folder per content, kept between runs (vLLM's "
                         "compile cache is keyed by the model path); default %(default)s")


def kept_folder(root: Path, name: str, write) -> Path:
    """``write(folder)`` fills a new folder, kept as ``root/<name>-<digest of its files>``: the
    same content always has the same path, and a folder once in place is never rewritten (the
    rename is atomic; a run that finds it there drops its own copy)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write(tmp)
        h = hashlib.sha256()
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(tmp).as_posix()}\0{f.stat().st_size}\0".encode())
            h.update(f.read_bytes())
        final = root / f"{name}-{h.hexdigest()[:12]}"
        if not final.exists():
            with contextlib.suppress(OSError):  # another run put the same content there first
                tmp.rename(final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
