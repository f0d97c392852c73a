"""FlashInfer on mixed pairs: CUTE_DSL_ARCH per rank, autotune off when capabilities differ."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from vllm.config.kernel import KernelConfig  # configures vLLM's logging before `records` hooks in

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import flashinfer as fi

CAPS = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)]


@pytest.mark.parametrize("cap", CAPS)
def test_arch_names_are_what_the_cute_dsl_itself_detects(cap, monkeypatch):
    env_manager = pytest.importorskip("cutlass.base_dsl.env_manager")
    enums = pytest.importorskip("cutlass.base_dsl.enums")
    monkeypatch.setattr(env_manager, "get_compute_capability_major_minor", lambda *a, **k: cap)
    name = fi.cute_dsl_arch(cap)
    assert name == env_manager.detect_gpu_arch("CUTE_DSL")
    assert enums.Arch[name] is not None  # a target the installed DSL knows


def test_arch_name_examples():
    assert fi.cute_dsl_arch((8, 9)) == "sm_89"
    assert fi.cute_dsl_arch((9, 0)) == "sm_90a"
    assert fi.cute_dsl_arch((12, 0)) == "sm_120a"


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def records():
    """Records of the package logger (vLLM's logging config stops propagation at 'vllm')."""
    log, handler = logging.getLogger("vllm.dualgpu"), _Collect()
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.records
    log.removeHandler(handler)
    log.setLevel(old)


@pytest.fixture
def no_dsl_yet(monkeypatch):
    monkeypatch.delitem(sys.modules, "cutlass", raising=False)
    rank_summary.clear()
    yield
    rank_summary.clear()


def test_sets_the_arch_for_this_rank(no_dsl_yet):
    env: dict[str, str] = {}
    value, why = fi.apply_cute_dsl_arch((8, 9), env)
    assert env == {"CUTE_DSL_ARCH": "sm_89"} and value == "sm_89"
    assert "8.9" in why
    assert rank_summary.facts()["CUTE_DSL_ARCH"].startswith("sm_89")


def test_the_users_value_wins(no_dsl_yet):
    env = {"CUTE_DSL_ARCH": "sm_100f"}
    value, why = fi.apply_cute_dsl_arch((12, 0), env)
    assert value == "sm_100f" and env["CUTE_DSL_ARCH"] == "sm_100f" and "user" in why


def test_warns_when_the_dsl_was_imported_first(no_dsl_yet, monkeypatch, records):
    monkeypatch.setitem(sys.modules, "cutlass", types.ModuleType("cutlass"))
    _, why = fi.apply_cute_dsl_arch((12, 0), {})
    assert "imported earlier" in why
    assert any(
        r.levelno == logging.WARNING and "CUTE_DSL_ARCH=sm_120a set after" in r.getMessage()
        for r in records
    )


def test_worker_uses_its_current_device(no_dsl_yet, monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    caps = {0: (12, 0), 1: (8, 9)}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[d])
    assert fi.set_cute_dsl_arch_for_current_device()[0] == "sm_89"
    import os

    assert os.environ["CUTE_DSL_ARCH"] == "sm_89"


@pytest.mark.parametrize("configured", [True, False, None])
def test_autotune_off_when_ranks_differ(configured):
    value, why = fi.decide_flashinfer_autotune([(8, 9), (12, 0)], configured)
    assert value is False
    assert "rank 0: 8.9" in why and "rank 1: 12.0" in why and "forever" in why
    # SM 9.0 and 12.0 both autotune, but tune different kernels: still off.
    assert fi.decide_flashinfer_autotune([(9, 0), (12, 0)], True)[0] is False


@pytest.mark.parametrize("configured", [True, False, None])
def test_autotune_off_for_pipeline_stages_on_equal_cards(configured):
    # Equal H200s hung in warm-up with autotune on: each stage tunes different ops over the
    # world group (vLLM #52291 / #57198).
    value, why = fi.decide_flashinfer_autotune([(9, 0), (9, 0)], configured)
    assert value is False
    assert "2 pipeline stages" in why and "world group" in why


@pytest.mark.parametrize("configured", [True, False, None])
def test_autotune_as_configured_for_one_rank(configured):
    value, why = fi.decide_flashinfer_autotune([(9, 0)], configured)
    assert value is configured
    assert "9.0" in why


def test_policy_sets_the_config_and_says_why(records):
    kc = KernelConfig(enable_flashinfer_autotune=True)
    assert fi.apply_flashinfer_autotune_policy(kc, [(12, 0), (8, 9)]) is False
    assert kc.enable_flashinfer_autotune is False
    (warning,) = [r for r in records if r.levelno == logging.WARNING]
    assert "turned off" in warning.getMessage() and "12.0" in warning.getMessage()
    records.clear()
    kc = KernelConfig(enable_flashinfer_autotune=True)
    assert fi.apply_flashinfer_autotune_policy(kc, [(9, 0), (9, 0)]) is False
    assert kc.enable_flashinfer_autotune is False
    # The normal pipeline case is reported, not warned about.
    assert [r.levelno for r in records if "autotune" in r.getMessage()] == [logging.INFO]


def test_vllm_reads_the_knob_the_policy_sets():
    import vllm

    src = (Path(vllm.__file__).parent / "model_executor/warmup/kernel_warmup.py").read_text()
    assert "worker.vllm_config.kernel_config.enable_flashinfer_autotune" in src
    assert "has_device_capability(90)" in src  # autotune runs only on SM 9.0+ ranks
    # The reason for the pipeline rule: timings are averaged over the world group. When vLLM
    # tunes per stage instead (vLLM PR #57198), this fails and the rule can go.
    body = src[src.index("def flashinfer_autotune("):]
    assert "world = get_world_group()" in body and "set_autotune_process_group(group)" in body
