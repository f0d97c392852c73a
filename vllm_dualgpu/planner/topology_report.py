"""Readable text for a :class:`~vllm_dualgpu.planner.topology.FleetPlan`: topologies side by side."""

from __future__ import annotations

import json

from vllm_dualgpu.planner.report import _grid, gib


def _per_replica(t, fn) -> str:
    vals = [fn(r) for r in t.fitting]
    return " + ".join(vals) if vals else "-"


def fleet_table(fp, routes: dict | None = None) -> str:
    lines = [f"Model: {fp.model.summary()}"]
    req = fp.request
    mml = {None: "the model's maximum", -1: "auto (the largest that fits)"}.get(req.max_model_len, f"{req.max_model_len:,}")
    lines.append(f"--max-model-len {mml}; KV cache {req.kv_cache_dtype}; batch at "
                 + (f"{req.decode_context_tokens:,} tokens" if req.decode_context_tokens else "--max-model-len")
                 + " of context per sequence")
    lines.append("Hosts: " + "; ".join(
        f"{h.name} = " + ", ".join(f"[{g.index}] {g.short_name} {g.total_bytes / (1 << 30):.1f} GiB" for g in h.gpus)
        for h in fp.fleet.hosts))
    lines.append("")
    fit = fp.fitting
    if fit:
        rows: list[tuple[str, list[str]]] = [("", [t.id for t in fit])]
        rows.append(("replicas", [_per_replica(t, lambda r: f"{r.name} {r.shape()}") for t in fit]))
        rows.append(("context that fits", [_per_replica(t, lambda r: f"{r.plan.max_context_tokens:,}") for t in fit]))
        rows.append(("--max-model-len", [_per_replica(t, lambda r: f"{r.plan.max_model_len:,}") for t in fit]))
        rows.append(("KV pool (tokens)", [_per_replica(t, lambda r: f"{r.plan.pool_tokens:,}") for t in fit]))
        rows.append(("KV cache per card", [_per_replica(t, lambda r: gib(min(x.kv_cache_bytes for x in r.plan.ranks))) for t in fit]))
        rows.append(("decode ms/step (1 stream)", [_per_replica(t, lambda r: "?" if r.decode_ms is None else f"{r.decode_ms:.1f}") for t in fit]))
        rows.append(("batch the pool allows", [_per_replica(t, lambda r: str(r.batch)) for t in fit]))
        rows.append(("decode tokens/s", [_per_replica(t, lambda r: "?" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}") for t in fit]))
        rows.append(("aggregate tokens/s", ["?" if t.tokens_per_s is None else f"{t.tokens_per_s:,.0f}" for t in fit]))
        rows.append(("cards idle", [str(len(t.idle)) for t in fit]))
        rows.append(("runs today", [t.status for t in fit]))
        lines.extend(_grid(rows))
        lines.append("")
    for t in fp.topologies:
        alias = f" (same as {', '.join(t.layout.aliases)})" if t.layout.aliases else ""
        lines.append(f"{t.id}: {t.layout.label}{alias}" + ("" if t.fits else " - does not fit"))
        for r in t.replicas:
            if r.fits:
                ranks = ", ".join(
                    f"{'+'.join(c.label for c in stage)} layers {pr.layers.start}-{pr.layers.stop - 1}"
                    for stage, pr in zip(r.stage_of_rank, r.plan.ranks)
                )
                lines.append(f"  {r.name} ({r.shape(cards=True)}): {ranks}")
                lines.append(f"    serve: {r.serve_today()[1]}")
                for n in r.notes:
                    lines.append(f"    note: {n}")
            else:
                lines.append(f"  {r.name}: {r.reason}")
        for c, why in t.idle:
            if t.fits:
                lines.append(f"  idle: {c.label} ({why})")
    lines.append("")
    if fp.recommended is not None:
        lines.append(f"Recommended: {fp.reason}.")
    else:
        lines.append(f"Nothing fits: {fp.what_fits()}.")
    for tid, rt in (routes or {}).items():
        lines.append("")
        lines.append(f"Route weights for {tid} ({rt['source']}): "
                     + ", ".join(f"{n} {w}" for n, w in rt["weights"].items()))
        gs = rt["gpustack"]
        lines.append(f"  GPUStack {gs['version']}: {gs['ui']}; or {gs['api']} with")
        lines.append("    " + json.dumps(gs["body"]))
        ps = rt["production_stack"]
        lines.append(f"  production-stack {ps['version']}: {ps['command']}")
        lines.append(f"    ({ps['note']})")
    lines.append("")
    lines.append("Speeds are bytes read per step over memory bandwidth plus estimated TP all-reduce and "
                 "pipeline-send latencies: lower bounds for comparing topologies, not measurements.")
    return "\n".join(lines) + "\n"
