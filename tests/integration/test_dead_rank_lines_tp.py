"""With TP groups as pipeline stages, a dead worker's line names its rank, stage, TP rank and GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_dualgpu.engine.rank_faults import dead_rank_lines  # noqa: E402


def test_a_tp_rank_is_named_with_its_stage():
    # ranks in vLLM's order: stage 0 = GPUs 1, 3; stage 1 = GPUs 0, 2
    gpus = [SimpleNamespace(physical_id=i, name=n) for i, n in
            ((1, "RTX 4070 Ti SUPER"), (3, "RTX 4070 Ti SUPER"), (0, "RTX 5090"), (2, "RTX 5090"))]
    workers = [SimpleNamespace(rank=r, proc=SimpleNamespace(exitcode=-9 if r == 3 else None)) for r in range(4)]
    (line,) = dead_rank_lines(workers, gpus, tp_size=2)
    assert line.startswith("vllm-dualgpu: rank 3 (stage 1, TP rank 1) (GPU 2: RTX 5090) was killed by signal 9")
