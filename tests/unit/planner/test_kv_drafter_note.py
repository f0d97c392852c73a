"""`plan` says when the executor's KV pricing can beat its stock mirror: a drafter whose
attention layers have their own KV spec next to a hybrid model (DFlash next to Qwen3.5)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_dualgpu.planner import DrafterSpec, KVLayout, ModelSpec, reference_config

DRAFTER = Path(__file__).resolve().parents[2] / "fixtures" / "dflash2_drafter_standin.json"


def layout_for(speculative: dict) -> KVLayout:
    model = ModelSpec.from_hf_config(reference_config("qwen3.8-27b"))
    drafter = DrafterSpec.from_speculative(speculative, model)
    return KVLayout.build(model, kv_cache_dtype="fp8", drafter=drafter)


def drafter_note(layout: KVLayout) -> list[str]:
    return [n for n in layout.notes if "own KV spec" in n]


def test_a_dflash_drafter_next_to_qwen3_5_is_noted():
    draft = json.loads(DRAFTER.read_text())
    layout = layout_for({"method": "dflash", "num_speculative_tokens": 8, "draft_config": draft})
    # 16 attention + 48 Gated DeltaNet layers + 5 drafter layers, cut to groups of 5 (stock):
    # cdiv(16, 5) + cdiv(48, 5) + 1 = 4 + 10 + 1 groups.
    assert len(layout.groups) == 15
    [note] = drafter_note(layout)
    assert "15 groups" in note and "dualgpu executor" in note


def test_mtp_shares_the_target_spec_and_is_not_noted():
    layout = layout_for({"method": "mtp", "num_speculative_tokens": 3})
    assert drafter_note(layout) == []
