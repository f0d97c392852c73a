"""A model as one tensor-parallel rank sees it: the config with its sharded dimensions divided.

vLLM's tensor parallelism splits every sharded matrix evenly over the group: attention heads and
KV heads (column-parallel q/k/v, row-parallel o), the MLP's intermediate size (gate/up, down),
MoE experts' intermediate sizes, Gated DeltaNet's key and value heads, and the vocabulary of the
embedding and the output head (``VocabParallelEmbedding`` pads it to a multiple of 64 first).
KV heads fewer than the group are replicated, one per rank. Norms and biases stay whole.

Rather than a second memory model, a TP group is planned by feeding the existing planner the
config of one shard: each card of the group then holds exactly what the planner computes for
that shard (weights, KV pages, Gated DeltaNet state, activations). What the shard config cannot
express is charged separately by the caller (see ``tp_extra_reserve``). Known approximation:
the vision tower's attention (``attn.qkv``/``attn.proj``) is sized unsharded, since the planner
derives those shapes from the vision hidden size, which also sizes the unsharded patch embedding
and merger; its MLP is sharded. For the bundled reference that overstates a card by ~0.13 GiB.
"""

from __future__ import annotations

import copy

from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.planner.memory import MemoryModel, pp_receive_bytes, sampler_bytes
from vllm_dualgpu.planner.model import ModelSpec

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (vocab_parallel_embedding.py)
VOCAB_PADDING = 64


def _div(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise BadRequest(f"tensor parallel size {tp} does not divide the model's {what} ({value}); vLLM "
                         f"refuses it: use a TP size that divides {value}")
    return value // tp


def shard_config(cfg: dict, tp: int) -> dict:
    """The ``config.json`` contents of one rank of a ``tp``-card tensor-parallel group.

    Raises :class:`BadRequest` when vLLM would refuse ``tp`` for this model (heads or sizes
    that ``tp`` does not divide).
    """
    if tp < 1:
        raise BadRequest("tensor parallel size must be >= 1")
    out = copy.deepcopy(cfg)
    if tp == 1:
        return out
    text = out.get("text_config") or out
    H = int(text["hidden_size"])
    nH = int(text["num_attention_heads"])
    hd = int(text.get("head_dim") or H // nH)
    nKV = int(text.get("num_key_value_heads") or nH)
    text["head_dim"] = hd  # keep the per-head size when the head count shrinks
    text["num_attention_heads"] = _div(nH, tp, "attention heads")
    if nKV >= tp:
        text["num_key_value_heads"] = _div(nKV, tp, "KV heads")
    else:
        if tp % nKV:
            raise BadRequest(f"tensor parallel size {tp} is not a multiple of the model's {nKV} KV heads; vLLM "
                             f"refuses it: use a TP size that divides {nKV} or a multiple of it")
        text["num_key_value_heads"] = 1  # replicated: one KV head per rank
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if text.get(key):
            text[key] = _div(int(text[key]), tp, key)
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        if text.get(key):
            text[key] = _div(int(text[key]), tp, key.replace("linear_num_", "Gated DeltaNet ").replace("_", " "))
    V = int(text["vocab_size"])
    padded = -(-V // VOCAB_PADDING) * VOCAB_PADDING
    text["vocab_size"] = -(-padded // tp)
    vc = out.get("vision_config")
    if isinstance(vc, dict) and vc.get("intermediate_size"):
        vc["intermediate_size"] = -(-int(vc["intermediate_size"]) // tp)
    meta = dict(out.get("_vllm_dualgpu") or {})
    base = meta.get("name") or out.get("_name_or_path") or (out.get("architectures") or ["model"])[0]
    meta["name"] = f"{base}, one TP-{tp} rank"
    out["_vllm_dualgpu"] = meta
    return out


def tp_extra_reserve(full: ModelSpec, shard: ModelSpec, tp: int, max_num_seqs: int, mm: MemoryModel, *,
                     max_num_batched_tokens: int = 0, dtype: str | None = None) -> int:
    """Memory a TP rank needs beyond what its shard config accounts for.

    * The sampler works on logits gathered to the full vocabulary (``LogitsProcessor`` gathers
      the vocab-parallel output), while the shard config sizes it for one slice: the difference.
    * The TP group's own NCCL communicator (``MemoryModel.tp_comms_pcie_bytes``): an estimate,
      not measured (an all-reduce group keeps more buffers than the pipeline's send/recv pair).
    * A second copy of the batch a stage receives: with TP, vLLM's ``irecv_tensor_dict`` receives
      each rank's slice into a full-size tensor and all-gathers it into another, and both live
      through the step (``memory.pp_receive_bytes``, ``max_num_batched_tokens`` tokens).

    Charged to every card of the group (only the last stage samples; a conservative choice).
    """
    if tp == 1:
        return 0
    sampler = sampler_bytes(full, max_num_seqs, mm) - sampler_bytes(shard, max_num_seqs, mm)
    gathered = pp_receive_bytes(full, max_num_batched_tokens, mm, dtype)
    return max(sampler, 0) + mm.tp_comms_pcie_bytes + gathered
