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

Not in vLLM's profile, but held while serving: on every stage but the first, the batch it
receives (``pp_receive_bytes``), which the worker also takes out of the KV room it reports.

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

Calibration on the virtual pair (docs/benchmarks.md "Fifth run", 2026-12-02: vLLM 0.33.0, a 16 GiB
and a 32 GiB card held on one H200, the reference Qwen3.5 shape in FP8 with MTP, fp8 KV, 2
sequences, 1,024 batched tokens, a 250,000-token prompt; per-process peaks from NVML):

* a process held 1.06 GiB when vLLM took its snapshot (16 - 14.94 and 32 - 30.94 GiB free, both
  ranks): ``cuda_context_bytes`` without NVLink; the NVLink calibration's 1.4 GiB stays as
  ``cuda_context_nvlink_bytes``. An H200's context is larger than a consumer card's;
* the pipeline's NCCL buffers measured 0.09 GiB a rank (``pp_comms_pcie_bytes``: 128 MiB);
* CUDA graphs took 0.07 and 0.14 GiB (0.13 and 0.20 with vLLM's default mode in an earlier run)
  when vLLM captures at most 16-32 tokens: ``cudagraph_small_bytes`` up to
  ``cudagraph_small_max_tokens`` captured tokens;
* FlashInfer keeps a 394 MiB workspace buffer (vLLM's ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``)
  per set of metadata builders: one for the target's attention on every rank that runs
  FlashInfer (v1/worker/gpu/attn_utils.py shares it across the groups), and a second on the last
  rank for a drafter's attention (its speculator calls ``init_attn_backend`` again,
  v1/worker/gpu/spec_decode/speculator.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_dualgpu.planner.formats import dense_format
from vllm_dualgpu.planner.model import ModelSpec

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryModel:
    """Per-rank runtime costs; every field is a knob to calibrate against a real boot."""

    #: what a worker's process holds before vLLM's snapshot (CUDA context, NCCL, loaded kernels):
    #: 1.06 GiB measured on the virtual pair (PCIe/socket transport), 1.4 GiB on NVLink H200s
    cuda_context_bytes: int = int(1.06 * GIB)
    cuda_context_nvlink_bytes: int = int(1.4 * GIB)
    workspace_bytes: int = 256 * MIB
    #: FlashInfer's workspace buffer (vLLM's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE default)
    flashinfer_workspace_bytes: int = 394 * MIB
    #: the dualgpu executor sets VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE itself (the user did not):
    #: :func:`plugin_flashinfer_workspace` instead of ``flashinfer_workspace_bytes``
    flashinfer_workspace_sized: bool = False
    #: vLLM grows the buffer to max_num_batched_tokens x query heads x head size x this
    #: (FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM, v1/attention/backends/flashinfer.py, 0.30-0.34)
    flashinfer_bytes_per_elem: int = 16
    cudagraph_bytes: int = 512 * MIB
    #: CUDA graphs when vLLM captures at most ``cudagraph_small_max_tokens`` tokens (small batches)
    cudagraph_small_bytes: int = 256 * MIB
    cudagraph_small_max_tokens: int = 64
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
    #: the same over PCIe (consumer cards: fewer channels, buffers in host memory without P2P):
    #: 0.09 GiB measured a rank on the virtual pair (NCCL's socket transport); the worker's
    #: summary line reports the real figure
    pp_comms_pcie_bytes: int = 128 * MIB
    #: a TP group's communicator over PCIe (planner/topology_shard.py): an estimate, not measured
    tp_comms_pcie_bytes: int = 256 * MIB
    #: tensors a later pipeline stage receives per batch and holds through the step, which vLLM's
    #: profile does not (``hidden_states`` and ``residual`` for vLLM's decoder models):
    #: ``pp_receive_bytes``; from vLLM 0.33's sources (``irecv_tensor_dict``), after a stage ran
    #: out of memory on the virtual pair (2026-12-02); not yet measured
    pp_receive_tensors: int = 2

    def context_bytes(self, nvlink: bool) -> int:
        """What a process holds before vLLM's snapshot, by the pair's link."""
        return self.cuda_context_nvlink_bytes if nvlink else self.cuda_context_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes(model: ModelSpec, num_tokens: int, mm: MemoryModel) -> int:
    """Transient peak of one forward pass over ``num_tokens`` batched tokens."""
    per_token = mm.activation_element_bytes * (4 * model.activation_width + 8 * model.hidden_size)
    return int(num_tokens * per_token)


def received_tensor_bytes(model: ModelSpec, num_tokens: int, dtype: str | None = None) -> int:
    """One tensor a later pipeline stage receives: ``num_tokens`` x the hidden size, in the dtype
    vLLM runs (``dtype``, the request's ``--dtype``; "auto" or None: the config's)."""
    return num_tokens * model.hidden_size * (dense_format(model.run_dtype(dtype)).bits // 8)


def pp_receive_bytes(model: ModelSpec, num_tokens: int, mm: MemoryModel, dtype: str | None = None) -> int:
    """What a later pipeline stage holds of the batch it receives, beside its forward pass: vLLM
    0.33's ``Worker.execute_model`` receives ``hidden_states`` and ``residual`` into new tensors and
    keeps them through the step, which vLLM's profile pass never does (it reads the runner's
    persistent buffer). ``mm.pp_receive_tensors`` of :func:`received_tensor_bytes`. A drafter's
    relayed hidden states (EAGLE3, DFlash) add tensors of the same size, which depend on the split:
    the search charges them per stage (``_Context.aux_receive_bytes``)."""
    return mm.pp_receive_tensors * received_tensor_bytes(model, num_tokens, dtype)


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


def attention_uses_flashinfer(kv_cache_dtype: str, capabilities) -> bool:
    """Whether vLLM 0.33 runs the target's attention on FlashInfer on these ranks (no backend
    chosen by the user). vLLM lists FlashAttention first, except on SM 10.x (FlashInfer first;
    platforms/cuda.py, ``_get_backend_priorities``); FlashAttention takes an fp8 KV cache only as
    FA3, on SM 9.0. With an fp8 KV cache and ranks of different capability the dualgpu executor sets
    FlashInfer on every rank (engine/attention_backend.py). An unknown capability counts as
    FlashInfer where an fp8 KV cache could make it so (the larger reserve)."""
    caps = [tuple(c) if c is not None else None for c in capabilities]
    known = {c for c in caps if c is not None}
    if str(kv_cache_dtype).startswith("fp8"):
        return len(known) != 1 or None in caps or (9, 0) not in known
    return any(c[0] == 10 for c in known)


def xqa_capability(capability) -> bool:
    """SM 9.0 or SM 12.x: the capabilities on which vLLM's FlashInfer backend decodes through XQA
    (``supports_trtllm_attention``, vLLM 0.30-0.34); also asked by the patch flashinfer-xqa-offline."""
    major, minor = tuple(capability)
    return (major, minor) == (9, 0) or major == 12


def xqa_decode(kv_cache_dtype: str, capability, model: ModelSpec) -> bool:
    """Whether a rank of this capability that runs the target's attention on FlashInfer decodes
    through FlashInfer's XQA kernels, and so holds vLLM's second workspace, the "trtllm" one
    (``_get_trtllm_workspace_buffer`` in v1/attention/backends/flashinfer.py, vLLM 0.30-0.34: a
    buffer of VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE bytes, not grown to the batch, allocated at the
    first XQA call, after the KV cache is sized). vLLM takes XQA for decode on SM 9.0 and SM 12.x
    (``supports_trtllm_attention``) where FlashInfer's cubins or NVIDIA's artifactory are at hand,
    and the dualgpu worker also where FlashInfer can build it (patch ``flashinfer-xqa-offline``);
    with query heads a multiple of the KV heads, a head size of 16-256 in steps of 16
    (``_is_xqa_head_dim_supported``, vLLM 0.33-0.34), and not for an NVFP4 cache on SM 9.0 (FA2 reads
    it there). An unknown capability counts as XQA (the larger reserve)."""
    cap = tuple(capability) if capability is not None else None
    if cap is not None and not xqa_capability(cap):
        return False
    if str(kv_cache_dtype).startswith("nvfp4") and cap is not None and cap[0] == 9:
        return False
    heads, kv_heads, head_dim = model.num_attention_heads, model.num_kv_heads, model.head_dim
    return bool(kv_heads) and heads % kv_heads == 0 and 16 <= head_dim <= 256 and head_dim % 16 == 0


def drafter_attention_backend(speculative: dict | None, target_flashinfer: bool) -> str | None:
    """The drafter's attention backend under the dualgpu executor, by name: the user's
    (``speculative_config.attention_backend``); else TRITON_ATTN for a DFlash drafter whose target
    runs FlashInfer; else None (the drafter takes the target's, as in vLLM).

    A DFlash drafter's sliding-window layers form a KV cache group of their own, so its backend need
    not match the target's; on FlashInfer it would build a second 394 MiB workspace on the last rank
    (vLLM's speculator initializes its attention backends again). The reference launchers run the
    drafter on TRITON_ATTN (their DRAFT_ATTN), measured on the virtual pair with the target on
    FlashInfer (benchmarks/results/2026-12-02-headline-virtual-run6). MTP and EAGLE drafters keep
    the target's: their layers share the target's attention KV layout."""
    spec = speculative or {}
    chosen = spec.get("attention_backend")
    if chosen:
        return str(getattr(chosen, "name", chosen)).rsplit(".", 1)[-1].upper()
    if spec.get("method") == "dflash" and target_flashinfer:
        return "TRITON_ATTN"
    return None


#: The most streaming multiprocessors of a card :func:`plugin_flashinfer_workspace` covers (the
#: RTX PRO 6000 has 188, an RTX 5090 170, an H200 132).
FLASHINFER_MAX_SMS = 192


def flashinfer_partials_bytes(model: ModelSpec, *, max_num_seqs: int, capture_tokens: int,
                              tp: int = 1, sms: int = FLASHINFER_MAX_SMS) -> int:
    """The most FlashInfer 0.7's plans take of the float workspace on a card of ``sms`` SMs: the
    split-KV partial outputs and their log-sum-exps, the only float allocations of the FA2 prefill
    and decode plans (include/flashinfer/attention/scheduler.cuh; FA3's ``PrefillSM90Plan`` takes
    none). Prefill (``PrefillPlanImpl``, ``batch_prefill_tmp_v`` / ``_tmp_s``): at most
    ``2 x sms / kv heads`` work items (``max_batch_size_if_split``), or under a CUDA graph the
    query tiles of the captured batch, each of ``cta_tile_q`` <= 128 packed rows (16 for the
    captured batches); rows = items x cta_tile_q / GQA group. Decode (``DecodePlanImpl``): at most
    its grid / kv heads items, the grid at most 16 blocks an SM (128 threads or more a block); one
    row a query head each. Every row holds ``head_dim + 1`` floats per query head. Independent of
    the context length: the KV chunk grows instead."""
    qo = max(1, model.num_attention_heads // tp)
    kv = max(1, model.num_kv_heads // tp)
    group = max(1, qo // kv)
    split_rows = (2 * sms // kv) * 128
    graph_rows = (-(-capture_tokens * group // 16) + max_num_seqs - 1) * 16
    prefill_rows = -(-max(split_rows, graph_rows) // group)
    decode_rows = 16 * sms // kv
    return qo * max(prefill_rows, decode_rows) * (model.head_dim + 1) * 4


def plugin_flashinfer_workspace(model: ModelSpec, *, max_num_seqs: int, capture_tokens: int,
                                tp: int = 1) -> int:
    """The FlashInfer workspace the dualgpu executor sets where the user did not
    (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``): twice :func:`flashinfer_partials_bytes` on a card
    of :data:`FLASHINFER_MAX_SMS`, rounded up to a MiB, never above vLLM's default. vLLM still
    grows it to its own estimate for the batch (:func:`flashinfer_workspace_size`)."""
    need = 2 * flashinfer_partials_bytes(model, max_num_seqs=max_num_seqs, capture_tokens=capture_tokens, tp=tp)
    return min(MemoryModel.flashinfer_workspace_bytes, -(-need // MIB) * MIB)


def configured_flashinfer_workspace(model: ModelSpec, *, max_num_seqs: int, decode_query_len: int = 1,
                                    tp: int = 1, mm: MemoryModel) -> int:
    """VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE as vLLM will read it: :func:`plugin_flashinfer_workspace`
    where the executor sets it (``mm.flashinfer_workspace_sized``), else the user's value or vLLM's
    default (``mm.flashinfer_workspace_bytes``)."""
    if not mm.flashinfer_workspace_sized:
        return mm.flashinfer_workspace_bytes
    return plugin_flashinfer_workspace(model, max_num_seqs=max_num_seqs, tp=tp,
                                       capture_tokens=cudagraph_capture_tokens(max_num_seqs, decode_query_len))


def flashinfer_workspace_size(model: ModelSpec, *, max_num_batched_tokens: int, max_num_seqs: int,
                              decode_query_len: int = 1, tp: int = 1, mm: MemoryModel) -> int:
    """The buffer vLLM allocates for one set of FlashInfer metadata builders: the configured size
    (:func:`configured_flashinfer_workspace`), grown to vLLM's own estimate for the batch
    (``FlashInferMetadataBuilder._get_workspace_buffer``: max_num_batched_tokens x query heads x
    head size x 16)."""
    configured = configured_flashinfer_workspace(model, max_num_seqs=max_num_seqs,
                                                 decode_query_len=decode_query_len, tp=tp, mm=mm)
    qo = max(1, model.num_attention_heads // tp)
    return max(configured, max_num_batched_tokens * qo * model.head_dim * mm.flashinfer_bytes_per_elem)


def cudagraph_capture_tokens(max_num_seqs: int, decode_query_len: int) -> int:
    """vLLM 0.33's largest CUDA-graph capture size by default (config/vllm.py,
    ``_set_cudagraph_sizes``): ``min(max_num_seqs x decode query length x 2, 512)``."""
    return min(max_num_seqs * decode_query_len * 2, 512)


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
    decode_query_len: int = 1,
    flashinfer: bool = False,
    drafter_flashinfer: bool = False,
    dtype: str | None = None,
) -> dict[str, int]:
    """Runtime reserve of one rank, itemised (``sum(values)`` is the reserve).

    The profile run's transient peak is the larger of the forward pass and the vision encoder
    pass (rank 0), which run one after the other; the last rank's sampler comes on top of the
    forward pass (measured: the last rank needs ~0.9 GiB more than a first rank).
    ``decode_query_len``: 1 + the draft tokens (sizes vLLM's CUDA graphs); ``flashinfer``: the
    target's attention runs FlashInfer (:func:`attention_uses_flashinfer`); ``drafter_flashinfer``:
    so does the drafter's, with a buffer of its own on the last rank.
    """
    peaks = {"activations": activation_bytes(model, max_num_batched_tokens, mm)}
    if first and vision:
        peaks["vision_encoder"] = vision_bytes(model, mm)
    top = max(peaks, key=lambda k: peaks[k])
    parts = {top: peaks[top], "workspaces": mm.workspace_bytes}
    buffers = int(flashinfer) + int(last and drafter_flashinfer)
    if buffers:
        parts["flashinfer_workspace"] = buffers * flashinfer_workspace_size(
            model, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            decode_query_len=decode_query_len, mm=mm)
    if last:
        parts["sampler"] = sampler_bytes(model, max_num_seqs, mm)
    small = cudagraph_capture_tokens(max_num_seqs, decode_query_len) <= mm.cudagraph_small_max_tokens
    parts["cuda_graphs"] = 0 if enforce_eager else (mm.cudagraph_small_bytes if small else mm.cudagraph_bytes)
    if not first:  # the batch it receives, held beside its forward pass
        parts["pp_receive"] = pp_receive_bytes(model, max_num_batched_tokens, mm, dtype)
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
