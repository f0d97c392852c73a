"""Virtual GPUs: several emulated cards on one physical GPU, for testing a mismatched pair.

``VLLM_DUALGPU_VIRTUAL_GPUS="RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB"`` (the ``--gpus`` syntax of
``vllm-dualgpu plan``: ``NAME[:TOTAL[:FREE]][:cc=X.Y][:display=yes|no]``; a card is headless
unless it says ``display=yes``, as the physical GPU is) makes the dualgpu executor see those
cards, in that order, instead of the GPUs NVML lists, all of them on the first visible GPU. The
real path runs on them: NVML facts -> plan -> executor -> workers -> vLLM's profiling. Each
rank then presents as its card (name, total and free memory, capability where the physical GPU
can run that capability's kernels) and is held to it (docs/virtual-gpus.md). Off unless the
variable is set; meant for tests and benchmarks on one large GPU, not for serving.

This module is pure (no torch, no vLLM): the parsing and the facts. The worker side is
:mod:`vllm_dualgpu.engine.virtual_card`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.planner.gpus import parse_gpus

ENV = "VLLM_DUALGPU_VIRTUAL_GPUS"
GiB = 1024**3


@dataclass(frozen=True)
class VirtualCard:
    """One emulated card, as its rank presents it (carried to the worker in the hand-off)."""

    name: str
    """As NVML names the real card (``NVIDIA GeForce RTX 4070 Ti SUPER``)."""
    total_bytes: int
    free_bytes: int
    """Free on the card before this run (the rest is held by others: a desktop, the driver)."""
    capability: tuple[int, int] | None
    """The real card's compute capability (what the planner uses)."""
    reported_capability: tuple[int, int]
    """What the rank's capability queries answer: the card's own where the physical GPU can
    run kernels built for it (same major, or older), else the physical GPU's."""
    physical_id: int
    physical_name: str
    physical_total_bytes: int
    display: bool = False
    """Whether the card presents as driving a display (``display=yes``): it then keeps the
    memory a desktop card keeps free. Default: headless, like the physical data-centre GPU."""
    physical_capability: tuple[int, int] | None = None
    """The physical GPU's compute capability."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> VirtualCard:
        d = dict(data)
        for key in ("capability", "reported_capability", "physical_capability"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    def describe(self) -> str:
        cc = self.reported_capability
        own = self.capability
        text = f"{self.name} {self.total_bytes / GiB:.1f} GiB (free {self.free_bytes / GiB:.1f})"
        text += f", capability {cc[0]}.{cc[1]}"
        if own is not None and tuple(own) != tuple(cc):
            text += f" (the card's {own[0]}.{own[1]} cannot run on the physical GPU)"
        return f"{text}, on GPU {self.physical_id} ({self.physical_name})"


def nvml_name(name: str) -> str:
    """The name NVML gives the real card: ``RTX 4070 Ti SUPER`` -> ``NVIDIA GeForce RTX 4070 Ti
    SUPER`` (GeForce RTX boards), ``H200`` -> ``NVIDIA H200``; a name with a vendor prefix stays."""
    text = " ".join(name.split())
    if text.lower().startswith("nvidia"):
        return text
    words = text.split()
    geforce = (len(words) >= 2 and words[0].upper() == "RTX" and words[1][:2].isdigit()
               and len(words[1]) == 4)
    return f"NVIDIA GeForce {text}" if geforce else f"NVIDIA {text}"


def runnable_capability(card: tuple[int, int] | None, physical: tuple[int, int]) -> tuple[int, int]:
    """The capability a virtual card's rank may answer on ``physical``: its own when kernels
    chosen for it run there (not newer than the physical GPU), else the physical one."""
    if card is None or tuple(card) > tuple(physical):
        return tuple(physical)
    return tuple(card)


def parse(spec: str, physical_id: int, physical_name: str, physical_total: int,
          physical_free: int, physical_capability: tuple[int, int]) -> list[VirtualCard]:
    """The cards of ``spec`` on the physical GPU described by the other arguments; raises
    :class:`BadRequest` with what to write when the spec is wrong or does not fit."""
    try:
        facts = parse_gpus(spec)
    except BadRequest as exc:
        raise BadRequest(f"{ENV}: {exc}") from None
    if len(facts) < 2:
        raise BadRequest(f"{ENV}={spec!r} names one card; name two or more, e.g. "
                         "'RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB'")
    need = sum(f.free_bytes for f in facts)
    if need > physical_free:
        raise BadRequest(
            f"{ENV}={spec!r}: the cards need {need / GiB:.1f} GiB free together, GPU "
            f"{physical_id} ({physical_name}) has {physical_free / GiB:.1f} GiB free; name smaller "
            "cards or free the GPU")
    cards = []
    for f in facts:  # parse_gpus filled a known card's capability (cc= wins)
        cards.append(VirtualCard(
            name=nvml_name(f.name), total_bytes=f.total_bytes, free_bytes=f.free_bytes,
            capability=tuple(f.capability) if f.capability else None,
            reported_capability=runnable_capability(f.capability, physical_capability),
            physical_id=physical_id, physical_name=physical_name,
            physical_total_bytes=physical_total, display=bool(f.display),
            physical_capability=tuple(physical_capability)))
    return cards


def ptx_compile_warning(cards: list[VirtualCard], kv_cache_dtype: str | None, backend: object, *,
                        model_dtype: object = None, use_mla: bool = False, multimodal: bool = False,
                        mm_backend: object = None) -> str | None:
    """One line for the log when a rank presents SM 8.x on a newer physical GPU and vLLM will run
    FlashAttention 2 there; else None. FA2 runs the decoder's attention with a 16-bit KV cache and
    a 16-bit model (no backend chosen; not MLA), and a vision encoder's attention (no
    ``--mm-encoder-attn-backend``: vLLM lists FLASH_ATTN first for it on SM 8.0+).

    vLLM 0.33 ships FlashAttention 2's kernels as SM 8.0 code only (cubins and PTX for sm_80, no
    sm_90): a real SM 8.x card runs the cubins, an SM 9.0 GPU has the driver compile each kernel
    from PTX on its first launch, on the CPU, a minute or more a kernel. Measured on one H200
    (2026-12-02): every first request of a PP=2 server waited on it, with rank 0's thread running and
    the GPU idle; the same server with ``--attention-backend TRITON_ATTN`` answered in 1.8 s."""
    older = [(r, c) for r, c in enumerate(cards)
             if c.physical_capability and c.reported_capability[0] == 8 < c.physical_capability[0]]
    if not older or use_mla or "float32" in str(model_dtype or "").lower():
        return None
    decoder = backend is None and not str(kv_cache_dtype or "auto").startswith("fp8")
    encoder = multimodal and mm_backend is None
    if not (decoder or encoder):
        return None
    c0 = older[0][1]
    pc = c0.physical_capability
    ranks = ", ".join(f"rank {r} ({c.reported_capability[0]}.{c.reported_capability[1]})" for r, c in older)
    what = " and ".join(w for w, on in (("its attention (a 16-bit KV cache)", decoder),
                                       ("its vision encoder", encoder)) if on)
    flags = " and ".join(f for f, on in (("--attention-backend TRITON_ATTN", decoder),
                                        ("--mm-encoder-attn-backend TORCH_SDPA", encoder)) if on)
    return (f"{ENV}: {ranks} present SM 8.x on GPU {c0.physical_id} ({c0.physical_name}, {pc[0]}.{pc[1]}): "
            f"vLLM runs FlashAttention 2 for {what} there, whose kernels it ships as SM 8.0 code only, so the "
            "driver compiles each from PTX on its first launch (a minute or more a kernel, on the CPU; the "
            f"first requests wait). {flags} avoids it; a real card of that capability runs the kernels as "
            "shipped")


def substitute(visible: list, spec: str | None):
    """``(gpus, cards)``: the visible GPUs (``nvml.VisibleGpu``) replaced by the virtual cards of
    ``spec`` on the first of them, with the cards; ``(visible, None)`` when ``spec`` is unset."""
    if not spec or not spec.strip():
        return visible, None
    if not visible:
        raise BadRequest(f"{ENV} is set, but NVML sees no GPU to put the virtual cards on")
    g = visible[0]
    cards = parse(spec, g.physical_id, g.name, g.total_bytes, g.free_bytes, tuple(g.capability))
    gpus = [
        replace(g, name=c.name, total_bytes=c.total_bytes, free_bytes=c.free_bytes,
                capability=c.capability or tuple(g.capability), bandwidth_gbps=None,
                uuid=f"{g.uuid}/virtual-{i}", nvlink=False, display=c.display)
        for i, c in enumerate(cards)
    ]
    return gpus, cards
