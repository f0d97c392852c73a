"""The executor's plan on a virtual pair (VLLM_DUALGPU_VIRTUAL_GPUS): real VllmConfigs, NVML
faked as one H200. The plan is made for the cards, every rank lands on the one GPU, and each
rank's hand-off carries its card."""

from __future__ import annotations

import pytest
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)
from test_planning import H200_TOTAL, make_config  # noqa: F401  (the module's config fixture)

from vllm_dualgpu import envs
from vllm_dualgpu.engine import handoff, preflight
from vllm_dualgpu.engine import planning as apply
from vllm_dualgpu.nvml import VisibleGpu

GiB, MiB = 1024**3, 1024**2
SPEC = "NVIDIA H200:32GiB,RTX 4070 Ti SUPER:16GiB"  # the big card first: the plan reorders


@pytest.fixture
def one_h200(monkeypatch):
    gpu = VisibleGpu(0, "NVIDIA H200", H200_TOTAL, 139 * GiB, (9, 0), 4800.0, "GPU-a")
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: [gpu])
    for var in ("VLLM_PP_LAYER_PARTITION", envs.RESERVE, "CUDA_VISIBLE_DEVICES", envs.PLAN_FILE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_DUALGPU_VIRTUAL_GPUS", SPEC)
    return gpu


def test_plan_for_the_cards_with_every_rank_on_the_gpu(make_config, one_h200):
    cfg = make_config()
    applied = apply.apply_plan(cfg)
    assert cfg.parallel_config.assigned_physical_gpu_ids == [0, 0]
    assert [g.name for g in applied.gpus] == ["NVIDIA GeForce RTX 4070 Ti SUPER", "NVIDIA H200"]
    ranks = handoff.load(cfg).ranks
    cards = [r.virtual_card for r in ranks]
    assert [c.total_bytes for c in cards] == [16 * GiB, 32 * GiB]
    assert [c.reported_capability for c in cards] == [(8, 9), (9, 0)]
    # budgets are the cards' (free - reserve), not the H200's 139 GiB; the cards are headless
    # (the spec says no display=yes), so each keeps 256 MiB free
    assert [r.reserve_bytes for r in ranks] == [256 * MiB, 256 * MiB]
    assert [r.budget_bytes for r in applied.plan.ranks] == [16 * GiB - 256 * MiB, 32 * GiB - 256 * MiB]
    split = applied.plan.partition
    assert split[0] < split[1]


def test_a_card_that_says_display_yes_keeps_what_a_desktop_card_keeps(make_config, one_h200, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_VIRTUAL_GPUS", "NVIDIA H200:32GiB:display=yes,RTX 4070 Ti SUPER:16GiB")
    cfg = make_config()
    apply.apply_plan(cfg)
    ranks = {r.virtual_card.name: r for r in handoff.load(cfg).ranks}
    assert ranks["NVIDIA H200"].reserve_bytes == GiB and ranks["NVIDIA H200"].virtual_card.display
    assert ranks["NVIDIA GeForce RTX 4070 Ti SUPER"].reserve_bytes == 256 * MiB


def test_the_same_plan_as_two_real_cards_of_those_sizes(make_config, one_h200, monkeypatch):
    """The emulation changes where the ranks run, not the plan: the split and pool equal those
    for two real headless GPUs with the cards' names and free memory."""
    virtual = apply.apply_plan(make_config()).plan
    monkeypatch.delenv("VLLM_DUALGPU_VIRTUAL_GPUS")
    real = [VisibleGpu(0, "NVIDIA H200", 32 * GiB, 32 * GiB, (9, 0), None, "GPU-a", False, display=False),
            VisibleGpu(1, "NVIDIA GeForce RTX 4070 Ti SUPER", 16 * GiB, 16 * GiB, (8, 9), None, "GPU-b", False,
                       display=False)]
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: real)
    plan = apply.apply_plan(make_config()).plan
    assert (virtual.partition, virtual.num_blocks, virtual.max_context_tokens) == \
        (plan.partition, plan.num_blocks, plan.max_context_tokens)


def test_tp_stages_turn_custom_all_reduce_off(make_config, one_h200, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_VIRTUAL_GPUS", "H200:24GiB,H200:24GiB,H200:24GiB,H200:24GiB")
    real_check = preflight.check
    # make_config's NVML sees two GPUs; four virtual cards make four
    monkeypatch.setattr(preflight, "check", lambda cfg, count=None: real_check(cfg, 4))
    cfg = make_config(tensor_parallel_size=2)
    cfg.parallel_config.disable_custom_all_reduce = False  # vLLM's CPU platform sets it; a GPU's does not
    apply.apply_plan(cfg)
    assert cfg.parallel_config.assigned_physical_gpu_ids == [0, 0, 0, 0]
    assert cfg.parallel_config.disable_custom_all_reduce is True


def test_a_bad_spec_is_refused_in_the_front_end(make_config, one_h200, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_VIRTUAL_GPUS", "RTX 4070 Ti SUPER:16GiB,:8GiB")
    with pytest.raises(ValueError, match="VLLM_DUALGPU_VIRTUAL_GPUS: --gpus entry"):
        make_config()


def test_cards_that_do_not_fit_the_gpu_are_refused(make_config, one_h200, monkeypatch):
    monkeypatch.setenv("VLLM_DUALGPU_VIRTUAL_GPUS", "H200:100GiB,H200:100GiB")
    cfg = make_config()
    with pytest.raises(ValueError, match="need 200.0 GiB free together"):
        apply.apply_plan(cfg)


def test_preflight_counts_the_virtual_cards(monkeypatch):
    import sys
    import types

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetCount=lambda: 1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("VLLM_DUALGPU_VIRTUAL_GPUS", raising=False)
    assert preflight.nvml_gpu_count() == 1
    monkeypatch.setenv("VLLM_DUALGPU_VIRTUAL_GPUS", SPEC)
    assert preflight.nvml_gpu_count() == 2


def test_each_worker_activates_its_own_card(make_config, one_h200, monkeypatch):
    from vllm_dualgpu.engine import virtual_card
    from vllm_dualgpu.engine import worker

    cfg = make_config()
    apply.apply_plan(cfg)
    seen = []
    monkeypatch.setattr(virtual_card, "activate", lambda card, rank: seen.append((card.name, rank)))
    for rank in (0, 1):
        worker._activate_virtual_card(cfg, rank)
    assert seen == [("NVIDIA GeForce RTX 4070 Ti SUPER", 0), ("NVIDIA H200", 1)]
    monkeypatch.delenv("VLLM_DUALGPU_VIRTUAL_GPUS")
    plain = make_config()
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: [one_h200, one_h200.__class__(
        1, "NVIDIA H200", H200_TOTAL, 139 * GiB, (9, 0), 4800.0, "GPU-b")])
    apply.apply_plan(plain)
    assert worker._activate_virtual_card(plain, 0) is None and len(seen) == 2


def test_the_executor_says_when_rank_0s_attention_kernels_compile_on_first_use(make_config, one_h200, caplog):
    """A 16-bit KV cache on the RTX 4070 Ti SUPER's rank (8.9 on the H200): vLLM picks FlashAttention 2,
    whose kernels the driver compiles from PTX on first launch; with a backend chosen, nothing."""
    import logging

    caplog.set_level(logging.WARNING, logger="vllm.dualgpu")
    logging.getLogger("vllm.dualgpu").propagate = True
    apply.apply_plan(make_config())
    warned = [r.getMessage() for r in caplog.records if "compiles each from PTX" in r.getMessage()]
    assert len(warned) == 1 and "rank 0 (8.9)" in warned[0], warned
    caplog.clear()
    apply.apply_plan(make_config(attention_backend="TRITON_ATTN"))
    assert not [r for r in caplog.records if "compiles each from PTX" in r.getMessage()]
