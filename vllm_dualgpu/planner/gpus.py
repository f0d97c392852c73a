"""GPU facts the planner needs, a small table of known cards, and the ``--gpus`` syntax."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from vllm_dualgpu.planner.errors import BadRequest

MIB = 1 << 20
GIB = 1 << 30


def rank_budget(free_bytes: int, reserve_bytes: int, cap_bytes: int | None = None,
                after_profile_bytes: int = 0) -> int:
    """The memory one rank gives vLLM: free memory minus the reserve, at most the cap.

    The one budget rule: the planner budgets each card with it before vLLM starts, and each
    worker applies it to its own card's free memory at its start snapshot. A worker also leaves
    out ``after_profile_bytes``, what vLLM allocates after its profile sized the KV cache (FlashInfer's
    workspace buffers) and so never charges.
    """
    budget = free_bytes - reserve_bytes
    return (budget if cap_bytes is None else min(budget, cap_bytes)) - after_profile_bytes


@dataclass(frozen=True)
class GpuFacts:
    """One card as the planner sees it.

    ``index`` is the CUDA/NVML index (PCI bus order). ``free_bytes`` is the free memory when
    planning (what NVML reports before vLLM starts); ``reserve_bytes`` is memory to leave free
    on that card for something else (a desktop, say). The planner budgets
    ``free_bytes - reserve_bytes`` and charges vLLM's own CUDA context and NCCL to the rank as a
    fixed cost. ``bandwidth_gbps`` (GB/s, decimal) feeds the decode-time estimate; ``capability``
    is the compute capability, e.g. ``(12, 0)``; ``nvlink`` whether the card has an active NVLink
    (NCCL's buffers for the pipeline are larger then; None: unknown, planned as PCIe);
    ``display`` whether it drives a display (None: unknown). The planner budgets with
    ``reserve_bytes`` only; the callers choose it from ``display`` (vllm_dualgpu/envs.py).
    """

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    bandwidth_gbps: float | None = None
    capability: tuple[int, int] | None = None
    reserve_bytes: int = 0
    nvlink: bool | None = None
    cap_bytes: int | None = None
    """An explicit ``--gpu-memory-utilization`` times the card's total: the budget's ceiling."""
    display: bool | None = None

    @property
    def budget_bytes(self) -> int:
        return rank_budget(self.free_bytes, self.reserve_bytes, self.cap_bytes)

    @property
    def short_name(self) -> str:
        n = re.sub(r"^(nvidia\s+)?(geforce\s+)?", "", self.name.strip(), flags=re.I)
        return n

    def with_known_defaults(self) -> "GpuFacts":
        """Fill bandwidth and capability from :data:`KNOWN_GPUS` when they are missing."""
        known = lookup(self.name)
        if known is None:
            return self
        return replace(
            self,
            bandwidth_gbps=self.bandwidth_gbps if self.bandwidth_gbps is not None else known.bandwidth_gbps,
            capability=self.capability if self.capability is not None else known.capability,
        )

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "reserve_bytes": self.reserve_bytes,
            "bandwidth_gbps": self.bandwidth_gbps,
            "capability": list(self.capability) if self.capability else None,
        }


@dataclass(frozen=True)
class KnownGpu:
    name: str
    aliases: tuple[str, ...]
    total_mib: int
    bandwidth_gbps: float
    capability: tuple[int, int]
    notes: str = field(default="", compare=False)

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MIB


# Totals are the MiB figures NVML reports for these boards; bandwidths are the vendor's
# memory-bandwidth specification (GB/s).
KNOWN_GPUS: tuple[KnownGpu, ...] = (
    KnownGpu("RTX 5090", ("rtx 5090",), 32607, 1792, (12, 0)),
    KnownGpu("RTX 5080", ("rtx 5080",), 16303, 960, (12, 0)),
    KnownGpu("RTX 5070 Ti", ("rtx 5070 ti",), 16303, 896, (12, 0)),
    KnownGpu("RTX 5070", ("rtx 5070",), 12227, 672, (12, 0)),
    KnownGpu("RTX 5060 Ti", ("rtx 5060 ti",), 16311, 448, (12, 0)),
    KnownGpu("RTX PRO 6000 Blackwell", ("rtx pro 6000 blackwell", "rtx pro 6000"), 97887, 1792, (12, 0)),
    KnownGpu("RTX 4090", ("rtx 4090",), 24564, 1008, (8, 9)),
    KnownGpu("RTX 4080 SUPER", ("rtx 4080 super",), 16376, 736, (8, 9)),
    KnownGpu("RTX 4080", ("rtx 4080",), 16376, 717, (8, 9)),
    KnownGpu("RTX 4070 Ti SUPER", ("rtx 4070 ti super",), 16376, 672, (8, 9)),
    KnownGpu("RTX 4070 Ti", ("rtx 4070 ti",), 12282, 504, (8, 9)),
    KnownGpu("RTX 4070 SUPER", ("rtx 4070 super",), 12282, 504, (8, 9)),
    KnownGpu("RTX 4070", ("rtx 4070",), 12282, 504, (8, 9)),
    KnownGpu("RTX 4060 Ti", ("rtx 4060 ti",), 16380, 288, (8, 9)),
    KnownGpu("RTX 6000 Ada", ("rtx 6000 ada",), 49140, 960, (8, 9)),
    KnownGpu("L40S", ("l40s",), 46068, 864, (8, 9)),
    KnownGpu("L4", ("l4",), 23034, 300, (8, 9)),
    KnownGpu("RTX 3090 Ti", ("rtx 3090 ti",), 24564, 1008, (8, 6)),
    KnownGpu("RTX 3090", ("rtx 3090",), 24576, 936, (8, 6)),
    KnownGpu("RTX 3080", ("rtx 3080",), 10240, 760, (8, 6)),
    KnownGpu("RTX 3060", ("rtx 3060",), 12288, 360, (8, 6)),
    KnownGpu("RTX A6000", ("rtx a6000",), 49140, 768, (8, 6)),
    KnownGpu("A100 80GB", ("a100 80gb", "a100-sxm4-80gb", "a100 80gb pcie"), 81920, 2039, (8, 0)),
    KnownGpu("A100 40GB", ("a100", "a100-sxm4-40gb", "a100 40gb"), 40960, 1555, (8, 0)),
    KnownGpu("H100", ("h100", "h100 80gb hbm3", "h100 sxm"), 81559, 3350, (9, 0)),
    KnownGpu("H100 PCIe", ("h100 pcie",), 81559, 2000, (9, 0)),
    KnownGpu("H200", ("h200",), 143771, 4800, (9, 0)),
    KnownGpu("B200", ("b200",), 183359, 8000, (10, 0)),
)


def _norm(name: str) -> str:
    s = name.lower().replace("_", " ").replace("-", " ")
    s = re.sub(r"\b(nvidia|geforce|tesla)\b", " ", s)
    return " ".join(s.split())


def lookup(name: str) -> KnownGpu | None:
    """The known card whose alias matches ``name`` best (longest whole-word alias)."""
    n = f" {_norm(name)} "
    best: tuple[int, KnownGpu] | None = None
    for g in KNOWN_GPUS:
        for a in g.aliases:
            a2 = f" {_norm(a)} "
            if a2 in n and (best is None or len(a2) > best[0]):
                best = (len(a2), g)
    return best[1] if best else None


def close_names(name: str, n: int = 3) -> list[str]:
    """Known cards whose name is close to ``name`` (a typo such as 'RTX 5900'), closest first."""
    import difflib

    names = {_norm(g.name): g.name for g in KNOWN_GPUS}
    return [names[k] for k in difflib.get_close_matches(_norm(name), list(names), n=n, cutoff=0.75)]


def unknown_gpu_message(name: str) -> str:
    """What to do about a ``--gpus`` name that is not in :data:`KNOWN_GPUS`: the close known
    names first (a typo), then how to give a card the table does not know."""
    close = close_names(name)
    if close:
        which = " or ".join(filter(None, [", ".join(map(repr, close[:-1])), repr(close[-1])]))
        return (f"unknown GPU {name!r}: did you mean {which}? A card "
                f"that is not in the table needs its memory, e.g. '{name}:24GiB'")
    return f"unknown GPU {name!r}: give its memory, e.g. '{name}:24GiB'"


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.I)


def parse_size(text: str, *, what: str = "size") -> int:
    """One reader for every memory size this package takes (``--gpus``, ``VLLM_DUALGPU_RESERVE``).

    ``'16GiB'``, ``'16G'`` (binary), ``'16GB'`` (decimal), ``'512MiB'``, ``'0'``. A bare number
    is GiB below 1024 and bytes from there (``'2'`` is 2 GiB, ``'4096'`` 4096 bytes).
    Raises :class:`BadRequest` (a ``ValueError``) naming ``what`` and an example.
    """
    m = _SIZE.match(text)
    if not m and _SIZE.match(text.strip().removeprefix("-")):
        raise BadRequest(f"{what}: {text!r} is negative; a memory size is 0 or more, e.g. 0, 512MiB, 1.5GiB")
    if not m:
        raise BadRequest(f"{what}: cannot read {text!r} as a memory size; write e.g. 0, 512MiB, 1.5GiB")
    num, unit = float(m.group(1)), m.group(2)
    if not unit:
        return int(num * GIB) if num < 1024 else int(num)
    u = unit.upper()
    if u == "B":
        mult = 1
    elif u.endswith("IB") or len(u) == 1:
        mult = 1 << (10 * "KMGT".index(u[0]) + 10)
    else:  # KB, MB, GB, TB: decimal
        mult = 10 ** (3 * "KMGT".index(u[0]) + 3)
    return int(num * mult)


def parse_gpus(spec: str) -> list[GpuFacts]:
    """Parse ``--gpus``: comma-separated ``NAME[:TOTAL[:FREE]][:key=value...]`` entries.

    The position in the list is the CUDA index. TOTAL defaults to the known card's total;
    FREE defaults to TOTAL. Keys: ``free=``, ``reserve=`` (memory to leave free, e.g. for a
    desktop), ``bw=`` (GB/s), ``cc=`` (e.g. ``8.9``), ``display=yes|no`` (whether the card
    drives a display; unsaid: unknown). Examples::

        RTX 4070 Ti SUPER,RTX 5090
        RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:30.5GiB:reserve=1GiB
        RTX 5090:display=yes,RTX 4070 Ti SUPER:display=no
        H200:141GiB:16GiB,H200:141GiB:32GiB
    """
    out: list[GpuFacts] = []
    entries = spec.split(",")
    if not spec.strip():
        raise BadRequest("--gpus is empty; write e.g. 'RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB', or --gpus local")
    if any(not e.strip() for e in entries):
        kept = ",".join(e.strip() for e in entries if e.strip())
        raise BadRequest(f"--gpus {spec!r} has an empty entry; write one name per GPU, e.g. --gpus '{kept}'")
    for index, entry in enumerate(entries):
        parts = [p.strip() for p in entry.split(":")]
        name = parts[0]
        if not name:
            raise BadRequest(f"--gpus entry {entry!r} has no name")
        positional = [p for p in parts[1:] if "=" not in p]
        keyed = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        known = lookup(name)
        if positional:
            total = parse_size(positional[0], what="--gpus")
        elif known is not None:
            total = known.total_bytes
        else:
            raise BadRequest(unknown_gpu_message(name))
        free = parse_size(positional[1], what="--gpus") if len(positional) > 1 else total
        if "free" in keyed:
            free = parse_size(keyed.pop("free"), what="--gpus free=")
        reserve = parse_size(keyed.pop("reserve"), what="--gpus reserve=") if "reserve" in keyed else 0
        bw = float(keyed.pop("bw")) if "bw" in keyed else None
        cc = None
        if "cc" in keyed:
            major, _, minor = keyed.pop("cc").partition(".")
            cc = (int(major), int(minor or 0))
        display = _yes_no(keyed.pop("display"), entry) if "display" in keyed else None
        if keyed:
            raise BadRequest(f"unknown --gpus key(s) {sorted(keyed)}; use free=, reserve=, bw=, cc=, display=")
        if free > total:
            raise BadRequest(f"--gpus entry {entry!r}: free memory is larger than total")
        out.append(
            GpuFacts(index, known.name if known and name.lower() == known.name.lower() else name, total, free, bw, cc,
                     reserve, display=display).with_known_defaults()
        )
    return out


def _yes_no(value: str, entry: str) -> bool:
    """A ``display=`` value: yes or no."""
    answer = {"yes": True, "no": False}.get(value.strip().lower())
    if answer is None:
        raise BadRequest(f"--gpus entry {entry!r}: display={value!r} is not yes or no; write display=yes "
                         "(the card drives a desktop) or display=no (it runs headless)")
    return answer


def reference_pair() -> list[GpuFacts]:
    """The reference box: an RTX 5090 at CUDA index 0 and an RTX 4070 Ti SUPER at index 1, both
    empty. No reserve and no display state: `vllm-dualgpu plan` adds the executor's reserve
    (VLLM_DUALGPU_RESERVE, else 1 GiB a card, as for a card whose display NVML cannot say)."""
    return parse_gpus("RTX 5090,RTX 4070 Ti SUPER")
