"""The per-rank summary's facts: a listing fact names each item once."""

from __future__ import annotations

from vllm_dualgpu import rank_summary


def test_add_lists_each_item_once():
    rank_summary.clear()
    try:
        for item in ("a", "b", "a", "b", "ab"):
            rank_summary.add("k", item)
        assert rank_summary.facts()["k"] == "a, b, ab"
    finally:
        rank_summary.clear()
