"""What a rank spends besides weights and KV cache: the runtime memory model.

These are ESTIMATES, kept in one place so they can be calibrated on real GPUs. What vLLM 0.30
measures at boot (``gpu_worker.determine_available_memory``):

* before its memory snapshot: the CUDA context and NCCL (``cuda_context_bytes``), invisible to
  ``--gpu-memory-utilization`` but missing from the card's free memory;
* in the profile run: the peak of transient activations for ``max_num_batched_tokens`` tokens
  (``activation_bytes``), on the last rank also the sampler's logits for ``max_num_seqs``
  requests (``sampler_bytes``), on rank 0 the vision encoder's profile pass;
* persistent allocations made after the snapshot besides weights (cuBLAS/FlashInfer
  workspaces, NCCL buffers: ``workspace_bytes``);
* CUDA graphs, which vLLM estimates and subtracts (``cudagraph_bytes``; 0 with
  ``--enforce-eager``).

Calibration point (from the project's measurement on two H200s with ballast, 14B-class dense
Qwen3, fp8 weights, bf16 KV): stock vLLM at ``--gpu-memory-utilization 0.10`` got 2,172 blocks
with an even 20/20 split, i.e. about 3.8 GiB of runtime memory on the last rank beyond weights and
KV. The defaults below predict within about 20% of that; see docs/planner.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_dualgpu.planner.model import ModelSpec

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryModel:
    """Per-rank runtime costs; every field is a knob to calibrate against a real boot."""

    cuda_context_bytes: int = 1 * GIB
    workspace_bytes: int = 256 * MIB
    cudagraph_bytes: int = 512 * MIB
    #: activation bytes per batched token per unit of (4 x widest intermediate + 8 x hidden)
    activation_element_bytes: int = 2
    #: bytes per (sequence x vocabulary entry) at the sampler: bf16 logits + ~4 fp32 copies
    sampler_bytes_per_logit: int = 18
    #: image patches the vision encoder's profile pass runs (about one 4-megapixel image)
    vision_profile_patches: int = 16384

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes(model: ModelSpec, num_tokens: int, mm: MemoryModel) -> int:
    """Transient peak of one forward pass over ``num_tokens`` batched tokens."""
    per_token = mm.activation_element_bytes * (4 * model.activation_width + 8 * model.hidden_size)
    return num_tokens * per_token


def sampler_bytes(model: ModelSpec, num_seqs: int, mm: MemoryModel) -> int:
    """Peak of the sampler's dummy run on the last rank (logits for ``num_seqs`` requests)."""
    return num_seqs * model.vocab_size * mm.sampler_bytes_per_logit


def vision_bytes(model: ModelSpec, mm: MemoryModel) -> int:
    """Peak of the vision encoder's profile pass on rank 0, plus its cached output."""
    if not model.has_vision:
        return 0
    p = mm.vision_profile_patches
    act = p * mm.activation_element_bytes * (4 * model.vision_intermediate_size + 8 * model.vision_hidden_size)
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
) -> dict[str, int]:
    """Runtime reserve of one rank, itemised (``sum(values)`` is the reserve).

    The profile run's transient peak is the largest of the forward pass, the sampler (last rank)
    and the vision encoder pass (rank 0): they run one after the other.
    """
    peaks = {"activations": activation_bytes(model, max_num_batched_tokens, mm)}
    if last:
        peaks["sampler"] = sampler_bytes(model, max_num_seqs, mm)
    if first and vision:
        peaks["vision_encoder"] = vision_bytes(model, mm)
    top = max(peaks, key=lambda k: peaks[k])
    parts = {top: peaks[top], "workspaces": mm.workspace_bytes}
    parts["cuda_graphs"] = 0 if enforce_eager else mm.cudagraph_bytes
    return {k: v for k, v in parts.items() if v}


def default_batch_limits(total_bytes_device0: int, name_device0: str = "") -> tuple[int, int]:
    """vLLM 0.30's ``vllm serve`` defaults (``EngineArgs.get_batch_defaults``, OpenAI server):
    (max_num_batched_tokens, max_num_seqs) from device 0's total memory."""
    if total_bytes_device0 >= 160 * GIB:
        return 16384, 1024
    if total_bytes_device0 >= 70 * GIB and "a100" not in name_device0.lower():
        return 8192, 1024
    return 2048, 256
