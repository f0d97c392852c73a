"""The machine profile: the memory bandwidth ``vllm-dualgpu calibrate`` measured on this machine's
GPUs, kept as JSON, and the one function (:func:`apply`) through which ``plan`` and the executor
give the planner those figures in place of the datasheet's.

The planner stays pure: it receives ``GpuFacts`` whose ``bandwidth_gbps`` is the measured read
figure. A GPU is matched by its NVML UUID when it has one (the executor's cards, ``plan --gpus
local``), else by its name (``--gpus`` specs), vendor prefixes and case aside ("NVIDIA GeForce RTX
5090" is "RTX 5090", "RTX 5090 D" is not). A GPU the profile does not name keeps its figure.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

SCHEMA = 1
FILE_NAME = "machine-profile.json"
NONE = "none"
"""``plan --profile none``: no profile, today's figures."""


class ProfileError(Exception):
    """A profile that cannot be read or is of another schema."""


@dataclass(frozen=True)
class MeasuredGpu:
    uuid: str | None
    name: str
    pci_bus_id: str | None
    total_bytes: int
    datasheet_gbps: float | None
    read_gbps: float
    copy_gbps: float


@dataclass(frozen=True)
class MachineProfile:
    created: str  # UTC, ISO 8601
    torch: str | None
    vllm: str | None
    gpus: tuple[MeasuredGpu, ...]
    schema: int = SCHEMA

    @property
    def date(self) -> str:
        return self.created[:10]

    def to_dict(self) -> dict:
        return {"schema": self.schema, "created": self.created, "torch": self.torch, "vllm": self.vllm,
                "gpus": [asdict(g) for g in self.gpus]}

    @classmethod
    def from_dict(cls, data: dict) -> MachineProfile:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else None
            raise ProfileError(f"schema {got!r}, this version reads schema {SCHEMA}")
        try:
            gpus = tuple(MeasuredGpu(uuid=g.get("uuid"), name=str(g["name"]), pci_bus_id=g.get("pci_bus_id"),
                                     total_bytes=int(g["total_bytes"]),
                                     datasheet_gbps=None if g.get("datasheet_gbps") is None else float(g["datasheet_gbps"]),
                                     read_gbps=float(g["read_gbps"]), copy_gbps=float(g["copy_gbps"]))
                         for g in data["gpus"])
            return cls(created=str(data["created"]), torch=data.get("torch"), vllm=data.get("vllm"), gpus=gpus)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"missing or malformed field ({type(e).__name__}: {e})") from None


def default_path() -> Path | None:
    """``$VLLM_DUALGPU_MACHINE_PROFILE`` (None where it says "none"), else
    ``$XDG_CACHE_HOME/vllm-dualgpu/machine-profile.json``, else the same under ``~/.cache``."""
    from vllm_dualgpu.envs import MACHINE_PROFILE

    env = os.environ.get(MACHINE_PROFILE, "").strip()
    if env:
        return None if env.lower() == NONE else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-dualgpu" / FILE_NAME


def write(profile: MachineProfile, path: Path | str) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def read(path: Path | str) -> MachineProfile:
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(str(e)) from None
    return MachineProfile.from_dict(data)


def _norm(name: str) -> str:
    s = re.sub(r"\b(nvidia|geforce|tesla)\b", " ", name.lower().replace("_", " ").replace("-", " "))
    return " ".join(s.split())


@dataclass(frozen=True)
class Applied:
    """What :func:`apply` gives: the cards with their figures, and what to say about it
    (``line``: which profile, None when none was used; ``warning``: a profile that could not be read)."""

    gpus: list
    path: str | None = None
    created: str | None = None
    line: str | None = None
    warning: str | None = None
    matches: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"path": self.path, "created": self.created, "line": self.line, "warning": self.warning,
                "gpus": self.matches}


def apply(gpus: list, uuids: list | None = None, path: Path | str | None = None,
          keep: set | frozenset = frozenset()) -> Applied:
    """``gpus`` (``GpuFacts``) with each matched card's ``bandwidth_gbps`` set to the profile's
    measured read bandwidth. ``uuids``: each card's NVML UUID (None where unknown); ``path``: the
    profile (None: :func:`default_path`, used only where it exists; ``"none"``: no profile);
    ``keep``: positions whose bandwidth the user gave (``--gpus 'NAME:bw=...'``), left alone."""
    if path is not None and str(path).strip().lower() == NONE:
        return Applied(list(gpus))
    where = Path(path).expanduser() if path is not None else default_path()
    if where is None or (path is None and not where.exists()):
        return Applied(list(gpus))
    try:
        profile = read(where)
    except ProfileError as e:
        return Applied(list(gpus), warning=(
            f"cannot use the machine profile {where} ({e}): run `vllm-dualgpu calibrate` again to "
            "measure this machine's GPUs; planning with datasheet bandwidths"))
    uuids = list(uuids) if uuids is not None else [None] * len(gpus)
    by_name: dict[str, list[MeasuredGpu]] = {}
    for m in profile.gpus:
        by_name.setdefault(_norm(m.name), []).append(m)
    taken: dict[str, int] = {}
    out, matches, said = [], [], []
    for pos, (g, uuid) in enumerate(zip(gpus, uuids)):
        how, m = None, None
        if pos in keep:
            how = "given"
        elif uuid:
            m = next((x for x in profile.gpus if x.uuid == uuid), None)
            how = "uuid" if m else None
        else:
            same = by_name.get(_norm(g.name), [])
            if same:  # the first card of a name gets the profile's first of that name, and so on
                k = taken.get(_norm(g.name), 0)
                m, how = same[min(k, len(same) - 1)], "name"
                taken[_norm(g.name)] = k + 1
        before = g.bandwidth_gbps
        if m is not None:
            g = replace(g, bandwidth_gbps=m.read_gbps)
            said.append(f"GPU {g.index} {m.read_gbps:,.0f} of {_gbps(before)} GB/s")
        elif how == "given":
            said.append(f"GPU {g.index} {_gbps(before)} GB/s as given (bw=)")
        else:
            said.append(f"GPU {g.index} {_gbps(before)} GB/s (not in the profile)")
        out.append(g)
        matches.append({"index": g.index, "name": g.name, "matched_by": how if m is not None else None,
                        "bandwidth_gbps": g.bandwidth_gbps, "previous_gbps": before})
    line = (f"Decode speed: measured bandwidths from {where} (calibrated {profile.date}): " + ", ".join(said))
    return Applied(out, str(where), profile.created, line, None, matches)


def _gbps(v: float | None) -> str:
    return "unknown" if v is None else f"{v:,.0f}"
