"""The headline's expert arm on the virtual pair runs the attention backend the real pair runs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import headline as hl  # noqa: E402

TOTAL = 139.8


def expert(tmp_path, virtual):
    return next(a for a in hl.arm_specs("fp8-mtp", tmp_path, total_gib=TOTAL, virtual=virtual)
                if a.kind == "expert")


def test_the_virtual_experts_ranks_share_flashinfer(tmp_path):
    assert expert(tmp_path, hl.VIRTUAL).kwargs["attention_backend"] == "FLASHINFER"


def test_two_real_gpus_leave_the_choice_to_vllm(tmp_path):
    assert "attention_backend" not in expert(tmp_path, None).kwargs
