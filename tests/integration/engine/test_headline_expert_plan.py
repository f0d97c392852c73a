"""The headline's expert arms as the executor plans them on the virtual pair (issue 28): each
launcher's own flags through the dualgpu executor start, with the expert's split and pool, and
a pool past the plan's reserves is a WARNING, not a refusal. NVML is faked as one H200; the
arms' engine arguments and environment are benchmarks/headline.py's.

Found with this test (twelfth session) and not fixed yet: for the three DFlash2 arms (the
expert's split and 1,664-token blocks) the executor's pricing with vLLM's own functions, under
the package's grouping patch (patches/kv_cache_utils.choose_grouping), keeps vLLM's stock
grouping (15 groups: 727 blocks a 262,144-token request), where the planner's mirror
(KVLayout.per_rank_grouping) picks 4 groups of 16 and the window group (190 blocks). The pool
set for the mirror's grouping then holds 38,272 / 116,480 / 59,904 tokens and the executor
refuses the arm at start. The same happens without --kv-cache-memory-bytes. At zero flags the
two agree (tests/integration/engine/test_kv_pricing_dflash.py). Which of the two is wrong is the
next step: the patch's cost is vLLM's `max_memory_usage_bytes` per group summed on each rank,
the mirror's is bytes per block times blocks per request, and the patch returns the stock
grouping outright when some layer is on no rank's list.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)

from vllm_dualgpu import envs
from vllm_dualgpu.engine import planning as apply
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.planner import PlanError

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import headline as hl  # noqa: E402

GiB = 1024**3
# the plan's expectation for each expert pool on the 16 + 32 GiB cards (tests/unit/
# test_headline_expert_blocks.py plans the same question): which rank it expects short
TIGHT = {"nvfp4-dflash2": [], "w8a16-dflash2": [0, 1], "fp8-dflash2": [0], "fp8-mtp": [0]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("headline-expert")
    out = {q: hl.write_reference_model(root / q, q) for q in ("w8a16", "fp8", "nvfp4")}
    out["drafter"] = hl.write_drafter(root / "dflash2-drafter")
    return out


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_MIRROR_VS_PATCH = ("the executor's vLLM-priced grouping keeps vLLM's 15 groups where the planner's mirror "
                    "groups 4 x 16 + the window: the pool sized for the mirror is refused (module docstring)")
EXPERT_ARMS = [pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=PlanError, reason=_MIRROR_VS_PATCH))
               if name.endswith("dflash2") else name for name in hl.LAUNCHERS]


@pytest.mark.parametrize("launcher", EXPERT_ARMS)
def test_the_expert_arm_starts_with_its_own_split_and_pool(engine_config, models, monkeypatch, launcher):
    gpu = VisibleGpu(0, "NVIDIA H200", int(hl.H200_TOTAL_GIB * GiB), 139 * GiB, (9, 0), 4800.0, "GPU-a")
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: [gpu])
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE, envs.OBJECTIVE):
        monkeypatch.delenv(var, raising=False)
    arm = next(a for a in hl.arm_specs(launcher, models[hl.QUANT[launcher]], total_gib=hl.H200_TOTAL_GIB,
                                       drafter=models["drafter"], virtual=hl.VIRTUAL) if a.kind == "expert")
    for k, v in arm.env.items():
        monkeypatch.setenv(k, v)
    cfg = engine_config(**arm.kwargs)
    cfg.parallel_config.worker_cls = apply.STOCK_WORKER  # as on a GPU machine; the plan replaces it
    log = logging.getLogger("vllm.dualgpu")
    handler = Warnings()
    log.addHandler(handler)
    try:
        plan = apply.apply_plan(cfg).plan
    finally:
        log.removeHandler(handler)
    assert plan.partition == hl.EXPERT[launcher]["partition"]
    assert plan.num_blocks == hl.EXPERT_BLOCKS[launcher] and plan.max_model_len == hl.MAX_MODEL_LEN
    assert cfg.parallel_config.assigned_physical_gpu_ids == [0, 0]
    short = [m for m in handler.messages if "is predicted short by" in m]
    assert len(short) == (1 if TIGHT[launcher] else 0), handler.messages
    for r in TIGHT[launcher]:
        assert f"rank {r} (" in short[0]
