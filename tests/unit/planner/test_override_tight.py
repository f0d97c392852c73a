"""--num-gpu-blocks-override that the plan's estimates say is tight: planned with a warning, not
refused (the user owns the pool, as in vLLM); refused only when the weights, fixed costs and the
pool alone exceed a card.

The reference setup runs its launchers with hand-set block counts that `plan` priced short by
its runtime reserves (issue 28: W8A16 + DFlash2 at 19/45 by 359 MiB on the 16 GiB card). Same
tiny model and pair as test_search.py, with 1 MiB of workspaces charged on each rank (the only
runtime reserve here):

  1/3: A 2,489,088 B after weights and embedding, 1,440,512 B after the reserve; B 4,321,024 B,
       3,272,448 B after the reserve (1 block = 8,192 B a layer: A 8,192 B, B 24,576 B).
  150 blocks: A 1,228,800 B fits; B 3,686,400 B is 413,952 B over its reserve-charged budget but
       within its 4,321,024 B. 2/2 needs 150 x 16,384 = 2,457,600 B on A, which has 1,308,160 B.
  200 blocks: B 4,915,200 B > 4,321,024 B with no reserve at all: refused as before.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_dualgpu.planner import ModelDoesNotFit, ModelSpec, plan
from vllm_dualgpu.planner.report import plan_table

from test_search import TINY, ZERO, pair, req

MIB = 1 << 20
ONE_MIB_WORKSPACE = replace(ZERO, workspace_bytes=MIB)


def test_a_pool_short_only_of_the_reserves_is_planned_with_a_warning():
    tiny = ModelSpec.from_hf_config(TINY)
    p = plan(tiny, pair(), req(max_model_len=64, num_gpu_blocks_override=150, memory=ONE_MIB_WORKSPACE))
    assert p.partition == [1, 3] and p.num_blocks == 150
    assert p.ranks[1].kv_cache_bytes == 150 * 24_576
    assert not [n for n in p.notes if "predicted short" in n]
    assert p.warnings == ["--num-gpu-blocks-override 150: rank 1 (B) is predicted short by 0.39 MiB of the memory the "
                     "plan keeps for vLLM's profile and the reserve; vLLM does not check the override against "
                     "memory, so it runs as you set it: if a rank runs out of memory, lower the override"]
    assert f"\nWarning: {p.warnings[0]}\n" in plan_table(p)  # what `vllm-dualgpu plan` prints
    assert p.to_dict()["warnings"] == p.warnings


def test_a_pool_larger_than_a_card_is_still_refused():
    tiny = ModelSpec.from_hf_config(TINY)
    with pytest.raises(ModelDoesNotFit, match="num-gpu-blocks-override 200"):
        plan(tiny, pair(), req(max_model_len=64, num_gpu_blocks_override=200, memory=ONE_MIB_WORKSPACE))


def test_a_pool_that_fits_has_no_warning():
    tiny = ModelSpec.from_hf_config(TINY)
    p = plan(tiny, pair(), req(max_model_len=64, num_gpu_blocks_override=100, memory=ONE_MIB_WORKSPACE))
    assert p.num_blocks == 100 and p.warnings == []
