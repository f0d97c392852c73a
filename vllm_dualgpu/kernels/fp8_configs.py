"""Tuned block-FP8 Triton configs: file names, search order and the per-rank lookup.

vLLM 0.30's ``get_w8a8_block_fp8_configs`` reads
``N={N},K={K},device_name={name},dtype=fp8_w8a8,block_shape=[{bn},{bk}].json`` from the
``configs/`` folder next to ``fp8_utils.py`` only, and names the card by device 0 on every rank.
The lookup here names the card by the CURRENT CUDA device (each pipeline rank has its own) and
searches, in order:

1. the folder(s) in ``VLLM_DUALGPU_KERNEL_CONFIGS`` (``os.pathsep``-separated),
2. the package's ``kernel_configs/`` (installed as ``vllm_dualgpu/kernel_configs``),
3. vLLM's own ``configs/`` folder.

A file that cannot be read, or whose configs the kernel cannot run correctly, is skipped with a
warning and the search goes on. Each rank logs one INFO line when it first looks a shape up
(where it searches and what it found), one WARNING the first time a shape falls back to vLLM's
default config, and records every shape's source for its summary line
(``rank_summary`` key ``fp8-configs``).

Nothing here imports torch or vLLM at module level: the CLI uses the file-name helpers on
machines without a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from vllm_dualgpu.log import logger

ENV_USER_DIR = "VLLM_DUALGPU_KERNEL_CONFIGS"
DTYPE = "fp8_w8a8"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
SUMMARY_KEY = "fp8-configs"

USER, PACKAGE, VLLM, DEFAULT = "user", "package", "vllm", "default"

_FILE_RE = re.compile(
    r"^N=(?P<N>\d+),K=(?P<K>\d+),device_name=(?P<device>.+),dtype=(?P<dtype>[A-Za-z0-9_]+),"
    r"block_shape=\[(?P<bn>\d+),\s*(?P<bk>\d+)\]\.json$"
)


class ConfigFileError(ValueError):
    """A config file that exists but cannot be used."""


@dataclass(frozen=True)
class ConfigFileKey:
    N: int
    K: int
    device_name: str
    dtype: str
    block_n: int
    block_k: int


@dataclass(frozen=True)
class Found:
    source: str  # USER, PACKAGE or VLLM
    path: Path


# --------------------------------------------------------------------------------------------
# File names
# --------------------------------------------------------------------------------------------


def device_name_as_file_name(name: str) -> str:
    """The card's name as vLLM writes it in config file names (utils/platform_utils.py:
    ``get_device_name_as_file_name``: runs of whitespace and slashes become one underscore)."""
    return re.sub(r"[\s/]+", "_", name)


def config_file_name(N: int, K: int, device_name: str, block_n: int = 128, block_k: int = 128,
                     dtype: str = DTYPE) -> str:
    """The file name vLLM's block-FP8 lookup asks for (``device_name`` already converted)."""
    return f"N={N},K={K},device_name={device_name},dtype={dtype},block_shape=[{block_n},{block_k}].json"


def parse_config_file_name(name: str) -> ConfigFileKey | None:
    """The key encoded in a config file name, or None for any other file."""
    m = _FILE_RE.match(os.path.basename(name))
    if m is None:
        return None
    return ConfigFileKey(int(m["N"]), int(m["K"]), m["device"], m["dtype"], int(m["bn"]), int(m["bk"]))


def list_config_files(folder: str | os.PathLike, dtype: str = DTYPE) -> list[tuple[ConfigFileKey, Path]]:
    """Block-FP8 config files in ``folder`` (sorted by device, N, K)."""
    out = []
    p = Path(folder)
    if not p.is_dir():
        return out
    for f in p.iterdir():
        key = parse_config_file_name(f.name)
        if key is not None and key.dtype == dtype and f.is_file():
            out.append((key, f))
    return sorted(out, key=lambda kv: (kv[0].device_name, kv[0].N, kv[0].K, kv[0].block_n))


# --------------------------------------------------------------------------------------------
# Folders and files
# --------------------------------------------------------------------------------------------


def package_config_dir() -> Path:
    """``kernel_configs/`` as installed (``vllm_dualgpu/kernel_configs``) or in a checkout."""
    import vllm_dualgpu

    pkg = Path(vllm_dualgpu.__file__).resolve().parent
    installed = pkg / "kernel_configs"
    if installed.is_dir():
        return installed
    return pkg.parent / "kernel_configs"


def user_config_dirs(env: dict | None = None) -> list[Path]:
    text = (os.environ if env is None else env).get(ENV_USER_DIR, "")
    return [Path(p).expanduser() for p in text.split(os.pathsep) if p.strip()]


def search_dirs(vllm_dir: str | os.PathLike | None, env: dict | None = None) -> list[tuple[str, Path]]:
    """Where configs are looked for, first match wins: user folder(s), package, vLLM."""
    dirs = [(USER, p) for p in user_config_dirs(env)]
    dirs.append((PACKAGE, package_config_dir()))
    if vllm_dir is not None:
        dirs.append((VLLM, Path(vllm_dir)))
    return dirs


def validate_configs(raw: object, block_k: int) -> dict[int, dict]:
    """vLLM's in-memory form ({M: config}) of a loaded JSON object, or ConfigFileError.

    Beyond vLLM's own reading (int keys), every entry must carry the six launch parameters as
    positive ints, and BLOCK_SIZE_K must divide the quantization block (the kernel loads one
    activation/weight scale per BLOCK_SIZE_K step, so a larger step gives wrong results).
    """
    if not isinstance(raw, dict) or not raw:
        raise ConfigFileError("not a non-empty JSON object of batch size -> config")
    out: dict[int, dict] = {}
    for key, cfg in raw.items():
        try:
            m = int(key)
        except (TypeError, ValueError):
            raise ConfigFileError(f"key {key!r} is not a batch size") from None
        if not isinstance(cfg, dict):
            raise ConfigFileError(f"entry {key!r} is not an object")
        missing = [k for k in CONFIG_KEYS if k not in cfg]
        if missing:
            raise ConfigFileError(f"entry {key!r} lacks {', '.join(missing)}")
        bad = [k for k in CONFIG_KEYS if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1]
        if bad:
            raise ConfigFileError(f"entry {key!r}: {', '.join(bad)} must be positive integers")
        if block_k % cfg["BLOCK_SIZE_K"]:
            raise ConfigFileError(
                f"entry {key!r}: BLOCK_SIZE_K={cfg['BLOCK_SIZE_K']} does not divide the "
                f"quantization block {block_k}"
            )
        out[m] = cfg
    return out


def load_config_file(path: str | os.PathLike, block_k: int) -> dict[int, dict]:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigFileError(f"cannot read: {exc}") from None
    return validate_configs(raw, block_k)


def find_config(N: int, K: int, block_n: int, block_k: int, device_name: str,
                dirs: list[tuple[str, Path]]) -> tuple[Found, dict[int, dict]] | None:
    """The first usable file for this shape and card along ``dirs``, loaded; None if none."""
    name = config_file_name(N, K, device_name, block_n, block_k)
    for source, folder in dirs:
        path = folder / name
        if not path.is_file():
            continue
        try:
            return Found(source, path), load_config_file(path, block_k)
        except ConfigFileError as exc:
            logger.warning("vllm-dualgpu: ignoring block-FP8 config %s: %s", path, exc)
    return None


def pick_config(configs: dict[int, dict], M: int) -> dict:
    """The entry vLLM uses for M rows: the nearest batch size (ties: the first in file order)."""
    return configs[min(configs.keys(), key=lambda x: abs(x - M))]


# --------------------------------------------------------------------------------------------
# The current device
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _file_name_of_device(index: int) -> str:
    import torch

    return device_name_as_file_name(torch.cuda.get_device_name(index))


def current_device_file_name() -> str | None:
    """The current CUDA device's name in file-name form; None while CUDA is not initialised
    (the caller then behaves like vLLM)."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return _file_name_of_device(torch.cuda.current_device())


# --------------------------------------------------------------------------------------------
# The per-rank lookup
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
# (device, N, K, block_n, block_k) -> (source, path or None), in lookup order.
_resolved: dict[tuple[str, int, int, int, int], tuple[str, Path | None]] = {}
_announced: set[str] = set()
_warned_default: set[str] = set()


def _shape_label(N: int, K: int, block_n: int, block_k: int) -> str:
    shape = f"{N}x{K}"
    return shape if (block_n, block_k) == (128, 128) else f"{shape}[{block_n},{block_k}]"


def summary(device_name: str | None = None) -> str:
    """``NVIDIA_H200: package 14336x5120 5120x6144; default 96x5120`` (one segment per card)."""
    with _lock:
        items = list(_resolved.items())
    by_device: dict[str, dict[str, list[str]]] = {}
    for (dev, N, K, bn, bk), (source, _) in items:
        if device_name is not None and dev != device_name:
            continue
        by_device.setdefault(dev, {}).setdefault(source, []).append(_shape_label(N, K, bn, bk))
    order = (USER, PACKAGE, VLLM, DEFAULT)
    parts = []
    for dev, groups in by_device.items():
        seg = "; ".join(f"{s} {' '.join(groups[s])}" for s in order if s in groups)
        parts.append(f"{dev}: {seg}")
    return " | ".join(parts)


def _record(device_name: str, N: int, K: int, block_n: int, block_k: int, source: str,
            path: Path | None, dirs: list[tuple[str, Path]]) -> None:
    from vllm_dualgpu import rank_summary

    shape = f"N={N},K={K},block=[{block_n},{block_k}]"
    with _lock:
        _resolved[(device_name, N, K, block_n, block_k)] = (source, path)
        first = device_name not in _announced
        _announced.add(device_name)
        first_default = source == DEFAULT and device_name not in _warned_default
        if first_default:
            _warned_default.add(device_name)
    rank_summary.note(SUMMARY_KEY, summary())
    if first:
        where = ", ".join(f"{s} {p}" for s, p in dirs)
        unset = "" if any(s == USER for s, _ in dirs) else f" ({ENV_USER_DIR} unset)"
        found = f"{source} file {path.name}" if path is not None else "none, vLLM's default config"
        logger.info(
            "vllm-dualgpu: block-FP8 Triton configs for %s are searched in: %s%s. %s: %s; the "
            "other shapes are listed in this rank's summary line.",
            device_name, where, unset, shape, found,
        )
    else:
        logger.debug("vllm-dualgpu: block-FP8 config for %s %s: %s %s", device_name, shape, source,
                     path if path is not None else "")
    if first_default:
        logger.warning(
            "vllm-dualgpu: no tuned block-FP8 Triton config for %s on %s: vLLM's default config "
            "is used (slower). `vllm-dualgpu tune-fp8 MODEL` writes one; put it in %s or in a "
            "folder named by %s.", shape, device_name, package_config_dir(), ENV_USER_DIR,
        )


@functools.lru_cache(maxsize=None)
def cached_lookup(N: int, K: int, block_n: int, block_k: int, device_name: str,
                  vllm_dir: str | None) -> dict[int, dict] | None:
    """vLLM's return value for this shape on this card: {M: config}, or None (default config).

    Cached by shape, card name and vLLM's folder; the user folder is read from the environment
    the first time (it is fixed for the life of a worker).
    """
    dirs = search_dirs(vllm_dir)
    hit = find_config(N, K, block_n, block_k, device_name, dirs)
    if hit is None:
        _record(device_name, N, K, block_n, block_k, DEFAULT, None, dirs)
        return None
    found, configs = hit
    _record(device_name, N, K, block_n, block_k, found.source, found.path, dirs)
    return configs


def resolved() -> dict[tuple[str, int, int, int, int], tuple[str, Path | None]]:
    with _lock:
        return dict(_resolved)


def reset_for_tests() -> None:
    cached_lookup.cache_clear()
    _file_name_of_device.cache_clear()
    with _lock:
        _resolved.clear()
        _announced.clear()
        _warned_default.clear()
