"""Readable text for a :class:`~vllm_dualgpu.planner.search.Plan` (``Plan.table()``)."""

from __future__ import annotations

from vllm_dualgpu.planner.objective import SPEED_TOLERANCE

GIB = 1 << 30
MIB = 1 << 20

_FIXED_LABELS = {
    "cuda_context": "  CUDA context + NCCL",
    "embedding": "  embedding",
    "vision": "  vision tower",
    "lm_head": "  output head (lm_head)",
    "final_norm": None,
    "drafter": "  drafter",
    "drafter_embedding": "  drafter's embedding copy",
}
_RESERVE_LABELS = {
    "activations": "  activations (profile run)",
    "sampler": "  sampler logits",
    "vision_encoder": "  vision encoder pass",
    "workspaces": "  workspaces",
    "flashinfer_workspace": "  FlashInfer workspaces",
    "xqa_workspace": "  FlashInfer XQA workspace",
    "cuda_graphs": "  CUDA graphs",
    "pp_comms": "  NCCL buffers (pipeline)",
    "pp_receive": "  received batch (pipeline)",
    "pp_receive_aux": "  received drafter inputs",
}


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


def size(n: int) -> str:
    if n >= GIB:
        return gib(n)
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    return f"{n / 1024:.1f} KiB"


def _grid(rows: list[tuple[str, list[str]]]) -> list[str]:
    w0 = max(len(r[0]) for r in rows)
    ncol = max(len(r[1]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows if i < len(r[1])) for i in range(ncol)]
    out = []
    for label, cells in rows:
        if label and not cells:
            out.append(label)
            continue
        parts = [label.ljust(w0)] + [c.rjust(widths[i]) for i, c in enumerate(cells)]
        out.append("  ".join(parts).rstrip())
    return out


def pool_lines(p) -> list[str]:
    """The KV pool three ways, each saying what it counts: the token slots of its blocks, the
    longest single request, and vLLM's own "KV cache size" figure at --max-model-len."""
    m = p.model
    state = p.kv.blocks_per_request_const
    held = "; one block is vLLM's null block" + (
        f", and a request takes {state} more for its recurrent layers' state" if state else "")
    lines = [
        f"KV pool: {p.num_blocks:,} blocks x {p.block_size:,} tokens ({p.num_blocks * p.block_size:,} token "
        f"slots); one request can hold up to {p.kv_max_context_tokens:,} tokens"
        + (f" (model maximum {m.max_position_embeddings:,})" if p.kv_max_context_tokens > m.max_position_embeddings else "")
        + held
    ]
    if p.max_model_len > 0:
        per = p.kv.blocks_per_request(p.max_model_len)
        lines.append(
            f"--max-model-len {p.max_model_len:,}: vLLM reports a KV cache of {p.pool_tokens:,} tokens, "
            f"{p.max_concurrency:.2f}x concurrency (its figure: {p.num_blocks:,} blocks / the {per:,} a request "
            f"of {p.max_model_len:,} tokens takes x {p.max_model_len:,})"
        )
    return lines


def plan_table(p) -> str:
    m = p.model
    kv = p.kv
    lines = [f"Model: {m.summary()}"]
    kvd = "model dtype" if p.request.kv_cache_dtype == "auto" else p.request.kv_cache_dtype
    lines.append(
        f"KV cache: {kvd}, {kv.attn_bytes_per_token:,} bytes per token per attention layer, "
        f"block {p.block_size} tokens"
        + (f"; Gated DeltaNet state {kv.mamba_page_bytes / MIB:.2f} MiB per layer" if kv.mamba_page_bytes else "")
    )
    if p.drafter is not None:
        lines.append(f"Speculative decoding: {p.drafter.name}, {p.drafter.num_speculative_tokens} tokens")
    if p.passthrough:
        lines.append("")
        lines.extend(p.notes)
        if not p.ranks:
            return "\n".join(lines) + "\n"
    lines.append("")

    ranks = p.ranks
    rows: list[tuple[str, list[str]]] = []
    rows.append(("", [f"rank {r.rank}" for r in ranks]))
    rows.append(("GPU (CUDA index)", [f"[{r.gpu.index}] {r.gpu.short_name}" for r in ranks]))
    rows.append(("total / free", [f"{r.gpu.total_bytes / GIB:.1f} / {r.gpu.free_bytes / GIB:.1f} GiB" for r in ranks]))
    if any(r.gpu.reserve_bytes for r in ranks):
        rows.append(("left free for others", [gib(r.gpu.reserve_bytes) for r in ranks]))
    rows.append(("layers", [f"{r.layers.start}-{r.layers.stop - 1} ({len(r.layers)})" for r in ranks]))
    rows.append(("weights of its layers", [gib(r.weights_bytes) for r in ranks]))
    rows.append(("fixed costs", [gib(r.fixed_bytes) for r in ranks]))
    keys = [k for k in _FIXED_LABELS if any(k in r.fixed_detail for r in ranks) and _FIXED_LABELS[k]]
    for k in keys:
        rows.append((_FIXED_LABELS[k], [gib(r.fixed_detail[k]) if k in r.fixed_detail else "-" for r in ranks]))
    rows.append(("runtime reserve", [gib(r.reserve_bytes) for r in ranks]))
    keys = [k for k in _RESERVE_LABELS if any(k in r.reserve_detail for r in ranks)]
    for k in keys:
        rows.append((_RESERVE_LABELS[k], [gib(r.reserve_detail[k]) if k in r.reserve_detail else "-" for r in ranks]))
    rows.append(("KV budget", [gib(r.kv_budget_bytes) for r in ranks]))
    rows.append(("KV bytes per block", [size(r.kv_bytes_per_block) for r in ranks]))
    rows.append(("blocks it could hold", [f"{r.blocks:,}" for r in ranks]))
    rows.append(("max context alone", [f"{r.max_context_tokens:,}" for r in ranks]))
    rows.append((f"KV cache ({p.num_blocks:,} blocks)", [gib(r.kv_cache_bytes) for r in ranks]))
    rows.append(("predicted free after", [gib(r.predicted_free_after_bytes) for r in ranks]))
    if all(r.predicted_decode_ms is not None for r in ranks):
        rows.append(("bandwidth", [f"{r.gpu.bandwidth_gbps:,.0f} GB/s" for r in ranks]))
        rows.append(("bytes read per step", [gib(r.decode_read_bytes) for r in ranks]))
        rows.append(("decode ms per step", [f"{r.predicted_decode_ms:.1f}" for r in ranks]))
    lines.extend(_grid(rows))
    lines.append("")

    if not p.passthrough:
        lines.append(
            f"GPU order {p.cuda_visible_devices()} (rank 0 first), layer split {p.partition_env()} "
            f"(of {p.candidates:,} candidates)"
        )
    lines.extend(pool_lines(p))
    ms = p.predicted_decode_ms
    if ms is not None:
        lines.append(
            f"Predicted decode: {ms:.1f} ms per step at {p.decode_context_tokens:,} tokens of context "
            f"({1000 / ms:.0f} steps/s; bytes read / memory bandwidth, a lower bound)"
        )
    if p.objective == "speed":
        held = (f"{p.max_num_seqs} requests of {p.max_model_len:,} tokens at once (--max-num-seqs)"
                if p.held_requests > 1 else f"--max-model-len {p.max_model_len:,}")
        why = (f"the fastest predicted decode among the splits that hold {held} (within "
               f"{SPEED_TOLERANCE:.1%}), then the largest pool")
    else:
        why = "the largest KV pool"
    if not p.passthrough and "layer_partition" not in p.overrides:
        lines.append(f"Chosen for {why}.")
    if p.overrides:
        lines.append("User overrides honoured: " + ", ".join(f"{k}={v}" for k, v in p.overrides.items()))
    for n in p.notes if not p.passthrough else []:
        lines.append(f"Note: {n}")
    lines.extend(f"Warning: {w}" for w in p.warnings)
    return "\n".join(lines) + "\n"
