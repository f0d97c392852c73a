"""A context that does not fit names the card that limits it and what is kept free on it, so a
user knows which knob is left (issue #28: W8A16 + DFlash2 holds 243,904 of 262,144 tokens on the
reference pair, where the RTX 5090 keeps 1 GiB free for its display)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_dualgpu import planner as P

ROOT = Path(__file__).resolve().parents[3]
DRAFTER = json.loads((ROOT / "tests" / "fixtures" / "dflash2_drafter_standin.json").read_text())


def refusal(gpus: str) -> str:
    """What `plan` answers for the W8A16 + DFlash2 launcher on ``gpus`` (each card keeping what the
    executor would keep free on it)."""
    from vllm_dualgpu.cli.inputs import with_default_reserves
    from vllm_dualgpu.patching.runtime import runtime_assumptions

    model = P.ModelSpec.from_hf_config(P.reference_config(), weight_format="int8")
    req = P.PlanRequest(max_model_len=262_144, kv_cache_dtype="fp8", max_num_seqs=2, max_num_batched_tokens=1024,
                        speculative={"method": "dflash", "num_speculative_tokens": 7, "draft_config": DRAFTER},
                        enable_prefix_caching=True, **runtime_assumptions().request_fields())
    f = P.fit(model, with_default_reserves(P.parse_gpus(gpus), gpus), req)
    assert not f.fits
    return str(f.error)


def test_the_refusal_names_the_tight_card_and_its_display_reserve():
    msg = refusal("RTX 5090:display=yes,RTX 4070 Ti SUPER:display=no")
    assert msg.startswith("--max-model-len 262,144 does not fit: the largest that fits is ")
    assert "rank 1, the RTX 5090, holds the fewest tokens and keeps 1.00 GiB free for others: a display is active on it" in msg
    assert "VLLM_DUALGPU_RESERVE" in msg


def test_a_card_of_unknown_display_says_so():
    """Offline, a card without display= keeps 1 GiB, as one with a display."""
    msg = refusal("RTX 5090,RTX 4070 Ti SUPER")
    assert "holds the fewest tokens and keeps 1.00 GiB free for others: its display is unknown;" in msg
