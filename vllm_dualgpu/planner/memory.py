"""What a rank spends besides weights and KV cache: the runtime memory model.

These are ESTIMATES, kept in one place so they can be calibrated on real GPUs. What vLLM 0.30
measures at boot (``gpu_worker.determine_available_memory``):

* before its memory snapshot: the CUDA context and NCCL (``cuda_context_bytes``), invisible to
  ``--gpu-memory-utilization`` but missing from the card's free memory;
* in the profile run: the peak of transient activations for ``max_num_batched_tokens`` tokens
  (``activation_bytes``), on the last rank also the sampler's logits for ``max_num_seqs``
  requests (``sampler_bytes``), on rank 0 the vision encoder's profile pass;
* persistent allocations made after the snapshot besides weights (cuBLAS/FlashInfer
  workspaces: ``workspace_bytes``; the pipeline's NCCL communicators, which the worker creates
  before profiling: ``pp_comms_first_bytes`` / ``pp_comms_last_bytes``);
* CUDA graphs, which vLLM estimates and subtracts (``cudagraph_bytes``; 0 with
  ``--enforce-eager``).

Calibration (docs/benchmarks.md, 2026-11-30, two H200s with ballast leaving 16 and 32 GiB, a
14B-class dense Qwen3 with block-FP8 weights, bf16 KV, eager, 16,384 batched tokens, 1,024
sequences): the activation, workspace and sampler constants below (CUDA context + NCCL 1.4 GiB,
activations 2.35 GiB, workspaces 0.25 GiB, sampler 0.85 GiB on the last rank) were fitted to the
first four runs. The pipeline communicators' NCCL buffers (``pp_comms_*``) were measured
directly by the worker on the same machine (0.79 GiB first rank, 1.04 GiB last). With them the
model predicted five later runs (splits 8/32 to 20/20) within 0.5-2.1% of the KV pool and the
first rank's KV budget within 256 MiB. Not yet checked on other models or cards; NCCL over PCIe
(the consumer pairs this package targets) uses fewer channels, so the comms term is likely high
there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_dualgpu.planner.model import ModelSpec

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryModel:
    """Per-rank runtime costs; every field is a knob to calibrate against a real boot."""

    #: what a worker's own CUDA context and NCCL take before vLLM's snapshot (measured ~1.4 GiB)
    cuda_context_bytes: int = int(1.4 * GIB)
    workspace_bytes: int = 256 * MIB
    cudagraph_bytes: int = 512 * MIB
    #: activation bytes per batched token per unit of (4 x widest intermediate + 8 x hidden)
    activation_element_bytes: float = 1.39
    #: bytes per (sequence x vocabulary entry) the last rank's sampler adds to the forward pass
    sampler_bytes_per_logit: float = 6.0
    #: image patches the vision encoder's profile pass runs (about one 4-megapixel image)
    vision_profile_patches: int = 16384
    #: NCCL buffers of the pipeline's communicators (hidden-state sends, sampled-token
    #: broadcast), which the worker creates before profiling, when the cards have NVLink:
    #: measured on two NVLink H200s (0.79 GiB on the first rank, 1.04 GiB on the last)
    pp_comms_first_bytes: int = int(0.79 * GIB)
    pp_comms_last_bytes: int = int(1.04 * GIB)
    #: the same over PCIe (consumer cards: fewer channels, buffers in host memory without P2P).
    #: An ESTIMATE, not measured yet; the worker's summary line reports the real figure.
    pp_comms_pcie_bytes: int = 256 * MIB

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes(model: ModelSpec, num_tokens: int, mm: MemoryModel) -> int:
    """Transient peak of one forward pass over ``num_tokens`` batched tokens."""
    per_token = mm.activation_element_bytes * (4 * model.activation_width + 8 * model.hidden_size)
    return int(num_tokens * per_token)


def sampler_bytes(model: ModelSpec, num_seqs: int, mm: MemoryModel) -> int:
    """Peak of the sampler's dummy run on the last rank (logits for ``num_seqs`` requests)."""
    return int(num_seqs * model.vocab_size * mm.sampler_bytes_per_logit)


def vision_bytes(model: ModelSpec, mm: MemoryModel) -> int:
    """Peak of the vision encoder's profile pass on rank 0, plus its cached output."""
    if not model.has_vision:
        return 0
    p = mm.vision_profile_patches
    act = int(p * mm.activation_element_bytes * (4 * model.vision_intermediate_size + 8 * model.vision_hidden_size))
    cached = (p // 4) * model.vision_out_hidden_size * 2
    return act + cached


def runtime_reserve(
    model: ModelSpec,
    *,
    first: bool,
    last: bool,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    enforce_eager: bool,
    vision: bool,
    mm: MemoryModel,
    nvlink: bool = False,
) -> dict[str, int]:
    """Runtime reserve of one rank, itemised (``sum(values)`` is the reserve).

    The profile run's transient peak is the larger of the forward pass and the vision encoder
    pass (rank 0), which run one after the other; the last rank's sampler comes on top of the
    forward pass (measured: the last rank needs ~0.9 GiB more than a first rank).
    """
    peaks = {"activations": activation_bytes(model, max_num_batched_tokens, mm)}
    if first and vision:
        peaks["vision_encoder"] = vision_bytes(model, mm)
    top = max(peaks, key=lambda k: peaks[k])
    parts = {top: peaks[top], "workspaces": mm.workspace_bytes}
    if last:
        parts["sampler"] = sampler_bytes(model, max_num_seqs, mm)
    parts["cuda_graphs"] = 0 if enforce_eager else mm.cudagraph_bytes
    if not (first and last):  # a pipeline stage: its communicators (middle ranks send and receive)
        if nvlink:
            parts["pp_comms"] = mm.pp_comms_first_bytes if first else mm.pp_comms_last_bytes
        else:
            parts["pp_comms"] = mm.pp_comms_pcie_bytes
    return {k: v for k, v in parts.items() if v}


def default_batch_limits(total_bytes_device0: int, name_device0: str = "") -> tuple[int, int]:
    """vLLM 0.30's ``vllm serve`` defaults (``EngineArgs.get_batch_defaults``, OpenAI server):
    (max_num_batched_tokens, max_num_seqs) from device 0's total memory."""
    if total_bytes_device0 >= 160 * GIB:
        return 16384, 1024
    if total_bytes_device0 >= 70 * GIB and "a100" not in name_device0.lower():
        return 8192, 1024
    return 2048, 256
