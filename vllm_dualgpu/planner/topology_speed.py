"""Decode speed of a replica: the planner's bytes-over-bandwidth step, plus TP and pipeline links.

Per pipeline stage (one card, or a TP group of equal cards planned as one shard) a decode step
over a micro-batch of ``m`` sequences takes

    t(m) = (weights read + m x per-sequence read) / card bandwidth            (the planner's model)
         + all-reduces x (latency + 2(t-1)/t x m x hidden x 2 bytes / link)   (TP groups only)

where the reads are the planner's own (``RankPlan.decode_read_bytes``: the stage's layers, the
head and drafter on the last stage, KV at ``decode_context_tokens`` and the recurrent state;
``KVLayout.bytes_per_token_read`` splits off the per-sequence part). A TP group runs two
all-reduces per decoder layer (after attention or Gated DeltaNet, after the MLP), one after the
vocab-parallel embedding on the first stage and one gather of the logits on the last.
Between stages the hidden state and the residual (``2 x hidden`` 16-bit values per sequence)
go over the link: PCIe inside a host, the network between hosts.

Single stream: the sum of the stage times and the hops at ``m = 1``. With ``B`` sequences vLLM
keeps ``n = min(PP, B)`` micro-batches of ``B / n`` in flight, and a micro-batch comes round
every ``max(sum of the stages and hops, n x slowest stage)``: that gives the aggregate rate.

ASSUMPTIONS (estimates, not measured on these cards): latencies and link speeds in
:class:`LinkModel`; no compute-bound term (decode is memory-bound at these batch sizes; the
estimate is a lower bound on step time, as the planner's is); the scheduler's own round trip
per step is left out (it is the same for every topology).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

HIDDEN_BYTES = 2  # the hidden state and residual travel in the model's 16-bit dtype


@dataclass(frozen=True)
class LinkModel:
    """Link speeds and per-message latencies the speed estimate uses (all ESTIMATES)."""

    #: card to card inside a host over PCIe; GeForce cards have no peer-to-peer, so NCCL copies
    #: through host memory: effective GB/s and latency of one small collective or send
    pcie_gbytes_per_s: float = 12.0
    pcie_latency_us: float = 25.0
    #: the same when every card of the group has an active NVLink
    nvlink_gbytes_per_s: float = 100.0
    nvlink_latency_us: float = 10.0
    #: between hosts (NCCL over TCP sockets): Gbit/s and latency of one send
    network_gbits_per_s: float = 10.0
    network_latency_us: float = 100.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LinkModel":
        from vllm_dualgpu.planner.errors import BadRequest

        known = set(cls.__dataclass_fields__)
        bad = sorted(set(d) - known)
        if bad:
            raise BadRequest(f"unknown link key(s) {bad}; use {', '.join(sorted(known))}")
        vals = {}
        for k, v in d.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise BadRequest(f"link {k}: {v!r} is not a positive number")
            vals[k] = float(v)
        return cls(**vals)


@dataclass(frozen=True)
class StageSpeed:
    """What one pipeline stage reads and sends per decode step."""

    weights_read_bytes: int  # read once per step, whatever the batch
    per_seq_read_bytes: int  # KV at the decode context + recurrent state, per sequence
    bandwidth_gbps: float  # GB/s of the slowest card of the stage
    tp: int
    allreduces: int  # per step (0 when tp == 1)
    nvlink: bool = False

    def ms(self, m: float, hidden: int, link: LinkModel) -> float:
        t = (self.weights_read_bytes + m * self.per_seq_read_bytes) / (self.bandwidth_gbps * 1e9) * 1e3
        if self.tp > 1:
            bw = link.nvlink_gbytes_per_s if self.nvlink else link.pcie_gbytes_per_s
            lat = link.nvlink_latency_us if self.nvlink else link.pcie_latency_us
            payload = 2 * (self.tp - 1) / self.tp * m * hidden * HIDDEN_BYTES
            t += self.allreduces * (lat * 1e-3 + payload / (bw * 1e9) * 1e3)
        return t


def hop_ms(m: float, hidden: int, link: LinkModel, *, network: bool) -> float:
    """One pipeline send of ``m`` sequences' hidden state and residual."""
    payload = 2 * m * hidden * HIDDEN_BYTES
    if network:
        return link.network_latency_us * 1e-3 + payload / (link.network_gbits_per_s * 1e9 / 8) * 1e3
    return link.pcie_latency_us * 1e-3 + payload / (link.pcie_gbytes_per_s * 1e9) * 1e3


def step_ms(stages: list[StageSpeed], hops: list[bool], m: float, hidden: int, link: LinkModel) -> float:
    """One decode step of one micro-batch through every stage (``hops[i]``: the send after stage
    ``i`` crosses the network)."""
    return sum(s.ms(m, hidden, link) for s in stages) + sum(hop_ms(m, hidden, link, network=n) for n in hops)


def throughput(stages: list[StageSpeed], hops: list[bool], batch: int, hidden: int, link: LinkModel) -> float:
    """Aggregate decode tokens/s with ``batch`` sequences running (see the module docstring)."""
    if batch < 1:
        return 0.0
    n = min(len(stages), batch)
    m = math.ceil(batch / n)
    cycle = max(step_ms(stages, hops, m, hidden, link), n * max(s.ms(m, hidden, link) for s in stages))
    return batch / cycle * 1e3
