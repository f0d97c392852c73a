"""A DualGpuWorker as a rank's process holds it after its KV cache was sized, for the tests of
how a failing rank ends: no device, its hand-off record, os._exit raising SystemExit, the
package's ERROR lines captured."""

from __future__ import annotations

import logging

from vllm_dualgpu.engine import handoff
from vllm_dualgpu.engine import worker as w


def ending_rank(monkeypatch, caplog, rank: int, gpu_name: str, reserve_bytes: int, layers: int):
    caplog.set_level(logging.ERROR, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True

    def ended(code):
        raise SystemExit(code)

    monkeypatch.setattr(w.os, "_exit", ended)
    r = object.__new__(w.DualGpuWorker)
    r.rank, r.device = rank, f"cuda:{rank}"
    r._dualgpu_rank = handoff.RankRecord(rank, 0, gpu_name, reserve_bytes, None, layers, None)
    return r
