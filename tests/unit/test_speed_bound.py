"""benchmarks/results/2026-12-04-speed-model/bound-vs-measured.json (issue #26's baseline): its
measured figures are the arms' own result files, and its bounds what the planner predicts now for
each arm's split and context (rewrite it with ``python benchmarks/speed_bound.py`` when the
planner's byte counts change)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import speed_bound as sb  # noqa: E402

DATA = json.loads(sb.OUT.read_text())


def test_every_measured_arm_and_context_is_there_with_the_run_figures():
    seen = set()
    for launcher, arm, path in sb.MEASURED:
        r = json.loads((sb.RESULTS / path).read_text())
        for key in sb.KEYS:
            m = r.get(key) or {}
            if m.get("decode_ms_per_step") is None:
                continue
            row = [x for x in DATA if (x["launcher"], x["arm"], x["context"]) == (launcher, arm, m["context"])]
            assert len(row) == 1, (launcher, arm, key)
            assert row[0]["measured_ms"] == m["decode_ms_per_step"] and row[0]["split"] == r["partition"]
            assert row[0]["source"] == f"benchmarks/results/{path}"
            seen.add((launcher, arm, m["context"]))
    assert len(seen) == len(DATA)


@pytest.mark.parametrize("row", DATA, ids=lambda x: f"{x['launcher']}-{x['arm']}-{x['context']}")
def test_the_bound_is_what_the_planner_predicts_now(row, tmp_path):
    assert sb.predicted_ms(row["launcher"], row["split"], row["context"], tmp_path) == pytest.approx(
        row["predicted_ms"], abs=0.006)


def test_the_bound_grows_with_the_context():
    """What the run is for: the bound reads more KV at a longer context (and still stays far below
    what the pair measured)."""
    for launcher, arm, _ in sb.MEASURED:
        rows = sorted((x for x in DATA if (x["launcher"], x["arm"]) == (launcher, arm)), key=lambda x: x["context"])
        assert all(a["predicted_ms"] < b["predicted_ms"] for a, b in zip(rows, rows[1:])), (launcher, arm)
