"""A decode model from measurements (issue #26 item 1): per-layer times fitted from runs of the
same model cut to different layer counts, turned into achieved fractions of a card's memory
bandwidth, and the step time those fractions predict for a rank's layers.

Per weight format and drafter (the target's layers run 1 + k tokens a step with k draft tokens),
one decode step at context ``c`` is modelled as

    ms(c) = fixed(c) + n_gdn x gdn + n_attention x attention(c)

``gdn`` (a Gated DeltaNet layer reads its weights and its state, whatever the context) is one
unknown; ``fixed(c)`` (embedding, head, sampling, scheduling, the drafter's pass: its attention
reads the context too) and ``attention(c)`` are one unknown per context. :func:`fit_layer_times`
solves them by least squares over the measured points and refuses a set of points that does not
determine them all (:class:`UnderDetermined`).

:func:`fractions_from_times` divides the bytes the planner says a layer reads
(:func:`layer_reads`: ``LayerSpec.decode_read_bytes``, the KV bytes per context token and twice
the recurrent state, read and written, as planner/search.py counts them) by the fitted times and
the card's bandwidth: the GDN fraction; for an attention layer, a line through its times at the
shortest and the longest context measured (its weights at no context, its KV read per token:
their two fractions); the fixed term as a line through the same two contexts. :func:`predict_step_ms` is the
estimate for a rank's layers from those fractions (not yet wired into planner/search.py).
Pure arithmetic: no vLLM, torch or CUDA import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllm_dualgpu.planner.hf_config import FULL, LINEAR


class UnderDetermined(ValueError):
    """The measured points do not determine every per-layer time and fixed term."""


@dataclass(frozen=True)
class Measured:
    """One decode step time (ms) of a model with these layers, at this context (tokens)."""

    gdn_layers: int
    attention_layers: int
    context: int
    ms: float


@dataclass(frozen=True)
class LayerTimes:
    """What :func:`fit_layer_times` solved: ms per GDN layer; per context, ms per attention layer
    and the fixed ms; the largest |fitted - measured| over the points."""

    gdn_ms: float
    attention_ms: dict[int, float]
    fixed_ms: dict[int, float]
    max_residual_ms: float
    points: int

    def step_ms(self, gdn_layers: int, attention_layers: int, context: int) -> float:
        return self.fixed_ms[context] + gdn_layers * self.gdn_ms + attention_layers * self.attention_ms[context]


def _solve(rows: list[list[float]], rhs: list[float], names: list[str]) -> list[float]:
    """Least squares through the normal equations (Gauss-Jordan, partial pivoting). A column that
    depends on the ones before it raises :class:`UnderDetermined` naming the unknowns that move
    together (the null direction: that column, less its pivot columns' coefficients)."""
    n = len(names)
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, rhs))]
         for i in range(n)]
    scale = max((abs(a[i][i]) for i in range(n)), default=1.0) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-9 * scale:
            tied = [names[j] for j in range(col) if abs(a[j][col]) > 1e-9] + [names[col]]
            raise UnderDetermined(f"the points do not tell apart {', '.join(tied[:-1]) or 'nothing'} and {tied[-1]}"
                                  if len(tied) > 1 else f"the points do not determine {names[col]}")
        a[col], a[piv] = a[piv], a[col]
        p = a[col][col]
        a[col] = [x / p for x in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] for i in range(n)]


def fit_layer_times(points: list[Measured]) -> LayerTimes:
    """Per-layer and fixed times from ``points`` (least squares). Determined when, at some
    context, three arms differ in their GDN and attention counts independently (for example 3 + 1,
    12 + 4 and 16 + 0 layers), and at every other context two arms have different attention
    counts."""
    contexts = sorted({p.context for p in points})
    names = ["the time of a GDN layer"]
    for c in contexts:
        names += [f"the fixed time at {c} tokens", f"the time of an attention layer at {c} tokens"]
    rows, rhs = [], []
    for p in points:
        row = [0.0] * len(names)
        row[0] = float(p.gdn_layers)
        i = 1 + 2 * contexts.index(p.context)
        row[i], row[i + 1] = 1.0, float(p.attention_layers)
        rows.append(row)
        rhs.append(float(p.ms))
    if len(rows) < len(names):
        raise UnderDetermined(f"{len(rows)} points for {len(names)} unknowns ({', '.join(names)})")
    x = _solve(rows, rhs, names)
    fitted = [sum(a * b for a, b in zip(r, x)) for r in rows]
    return LayerTimes(
        gdn_ms=x[0],
        attention_ms={c: x[2 + 2 * i] for i, c in enumerate(contexts)},
        fixed_ms={c: x[1 + 2 * i] for i, c in enumerate(contexts)},
        max_residual_ms=max(abs(f - y) for f, y in zip(fitted, rhs)),
        points=len(rows),
    )


@dataclass(frozen=True)
class LayerRead:
    """What one decoder layer reads per decode step, as the planner counts it."""

    kind: str  # FULL or LINEAR
    weight_bytes: int
    kv_bytes_per_token: int = 0  # attention: K + V per context token
    state_bytes: int = 0  # Gated DeltaNet: the recurrent and conv state (read and written)

    def bytes_at(self, context: int) -> int:
        return self.weight_bytes + context * self.kv_bytes_per_token + 2 * self.state_bytes


def layer_reads(model, kv_cache_dtype: str = "fp8", num_speculative_tokens: int = 0) -> list[LayerRead]:
    """Every decoder layer's reads for ``model`` (a ``ModelSpec``), from the planner's own
    counts: ``decode_read_bytes`` and the KV layout's unpadded bytes per token and state."""
    from vllm_dualgpu.planner.kv import KVLayout

    kv = KVLayout.build(model, kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=num_speculative_tokens)
    per_tok = [0] * model.num_layers
    state = [0] * model.num_layers
    for s in kv.slots:
        if s.layer_index is not None:
            per_tok[s.layer_index] += s.real_bytes_per_token
            state[s.layer_index] += s.state_bytes
    return [LayerRead(layer.kind, layer.decode_read_bytes, per_tok[i], state[i])
            for i, layer in enumerate(model.layers)]


@dataclass(frozen=True)
class DecodeFractions:
    """A decode model for one weight format and drafter: achieved fractions of the card's memory
    bandwidth (``bandwidth_gbps``, the figure they were measured against) and the fixed term,
    ``fixed_ms + fixed_ms_per_token x context`` (card-specific, not scaled by bandwidth). A
    fraction is None where its fitted time was not positive (``notes`` says which); ``kv`` None
    also where one context was measured: the attention fraction then covers the KV read."""

    weight_format: str
    drafter: str
    gdn: float | None
    attention: float | None
    kv: float | None
    fixed_ms: float
    fixed_ms_per_token: float
    bandwidth_gbps: float
    run: str  # the run that produced these numbers
    notes: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> DecodeFractions:
        return cls(**{**d, "notes": tuple(d.get("notes") or ())})


def fractions_from_times(times: LayerTimes, gdn: LayerRead, attention: LayerRead, *, bandwidth_gbps: float,
                         weight_format: str, drafter: str, run: str) -> DecodeFractions:
    """The fractions of ``bandwidth_gbps`` (GB/s) that the fitted times achieve on the bytes the
    planner counts for one GDN layer (``gdn``) and one attention layer (``attention``)."""
    if gdn.kind != LINEAR or attention.kind != FULL:
        raise ValueError(f"need a {LINEAR} and a {FULL} layer, not {gdn.kind} and {attention.kind}")
    bw = bandwidth_gbps * 1e9
    notes = []

    def frac(nbytes: float, ms: float, what: str) -> float | None:
        if ms <= 0:
            notes.append(f"{what}: fitted time {ms:.4g} ms is not positive")
            return None
        return nbytes / (ms / 1e3) / bw

    lo, hi = min(times.attention_ms), max(times.attention_ms)
    g = frac(gdn.bytes_at(0), times.gdn_ms, "GDN layer")
    if hi == lo:
        a = frac(attention.bytes_at(lo), times.attention_ms[lo], "attention layer")
        return DecodeFractions(weight_format, drafter, g, a, None, times.fixed_ms[lo], 0.0, bandwidth_gbps, run,
                               tuple(notes + [f"one context ({lo} tokens): the KV read is not separated"]))
    # lines through the shortest and the longest context: exact at both, the others are checks
    kv_ms = (times.attention_ms[hi] - times.attention_ms[lo]) / (hi - lo)  # ms per context token
    a = frac(attention.weight_bytes, times.attention_ms[lo] - lo * kv_ms, "attention weights")
    kv = frac(attention.kv_bytes_per_token, kv_ms, f"KV read between {lo} and {hi} tokens")
    per_tok = (times.fixed_ms[hi] - times.fixed_ms[lo]) / (hi - lo)
    return DecodeFractions(weight_format, drafter, g, a, kv, times.fixed_ms[lo] - lo * per_tok, per_tok,
                           bandwidth_gbps, run, tuple(notes))


def predict_step_ms(reads: list[LayerRead], fractions: DecodeFractions, *, context: int, bandwidth_gbps: float,
                    fixed: bool = True) -> float:
    """One decode step's estimate for the layers ``reads`` (a rank's: ``layer_reads(model)[start:end]``)
    at ``context`` tokens on a card of ``bandwidth_gbps``: each layer's bytes over its achieved
    bandwidth, plus the fixed term when ``fixed`` (measured with the whole model on one card: the
    pipeline hop and a second rank's own per-step cost are not in it). A fraction the layers need
    that is None raises ValueError."""
    kinds = {r.kind for r in reads}
    missing = [k for k, f in ((LINEAR, fractions.gdn), (FULL, fractions.attention)) if k in kinds and f is None]
    if missing:
        raise ValueError(f"no achieved fraction for {', '.join(missing)} layers: {'; '.join(fractions.notes)}")
    bw = bandwidth_gbps * 1e9
    s = 0.0
    for r in reads:
        if r.kind == LINEAR:
            s += r.bytes_at(context) / (fractions.gdn * bw)
        else:
            s += r.weight_bytes / (fractions.attention * bw)
            s += context * r.kv_bytes_per_token / ((fractions.kv or fractions.attention) * bw)
    ms = s * 1e3
    if fixed:
        ms += fractions.fixed_ms + fractions.fixed_ms_per_token * context
    return ms
