"""flashinfer-xqa-offline: an SM 9.0 / 12.x rank that cannot reach NVIDIA's artifactory still
decodes with FlashInfer's XQA when FlashInfer can JIT-build it; everything else is vLLM's answer.

vLLM's real ``vllm.utils.flashinfer`` and FlashInfer backend; faked: the current device's
capability, ``has_nvidia_artifactory``'s answer, and the toolkit (a CUDA_HOME and PATH holding
an executable ``nvcc`` / ``ninja``, or not), which vLLM's own ``_flashinfer_nvcc_path`` reads.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from vllm_dualgpu.patches import flashinfer_utils

NAME = "flashinfer-xqa-offline"


def _tool(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


@pytest.fixture
def rank(monkeypatch, tmp_path, vllm_version):
    """A rank: its current device's capability, the artifactory's answer, and a toolkit."""
    import vllm.config.vllm
    import vllm.utils.flashinfer as fi
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability

    class Rank:
        cap = (9, 0)
        online = False

        def toolkit(self, nvcc=True, ninja=True):
            kit = tmp_path / f"nvcc{nvcc}-ninja{ninja}"
            home, bin_ = kit / "cuda", kit / "bin"
            bin_.mkdir(parents=True)
            if nvcc:
                _tool(home / "bin", "nvcc")
            if ninja:
                _tool(bin_, "ninja")
            monkeypatch.setenv("CUDA_HOME", str(home))
            monkeypatch.setenv("PATH", str(bin_))
            flashinfer_utils.jit_can_build.cache_clear()

    r = Rank()
    monkeypatch.setattr(vllm.config.vllm, "_current_vllm_config", VllmConfig())  # the worker's
    monkeypatch.setattr(type(fi.current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*r.cap)))
    monkeypatch.setattr(fi, "has_nvidia_artifactory", lambda: r.online)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(flashinfer_utils, "_said", set())
    r.toolkit()
    yield r
    flashinfer_utils.jit_can_build.cache_clear()


def backend_module():
    """vLLM's FlashInfer backend (the patch's copy holder), or None where it does not import here:
    vLLM 0.30's FlashInfer (0.6.18) asks the CUDA device at import, which a CPU-only torch refuses
    ("Torch not compiled with CUDA enabled"). A holder not yet imported binds the patched function
    itself when a GPU worker imports it (patching/core.py)."""
    try:
        import vllm.v1.attention.backends.flashinfer as backend
    except (ImportError, AssertionError, RuntimeError):
        return None
    return backend


def _entry(vllm_version):
    from vllm_dualgpu.patching.registry import for_version

    p = for_version(NAME, vllm_version)
    assert p is not None, f"no {NAME} entry for vLLM {vllm_version}"
    return p


@pytest.fixture
def patched(vllm_version):
    from _ported import unpatched

    from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch

    p = _entry(vllm_version)
    with unpatched(p, vllm_version):
        holder = backend_module()  # a copy holder, imported where it can be
        out = apply_patch(p, vllm_version)
        assert out.status == APPLIED, out.reason
        assert out.rebound == (["vllm.v1.attention.backends.flashinfer"] if holder else [])
        assert apply_patch(p, vllm_version).status == ALREADY  # idempotent
        yield p


def supports(is_prefill):
    """What vLLM's callers get: the module global, its @cache cleared (the fakes change)."""
    import vllm.utils.flashinfer as fi

    fi.supports_trtllm_attention.__wrapped__.cache_clear()
    return fi.supports_trtllm_attention(is_prefill=is_prefill)


def vllms(is_prefill):
    import vllm.utils.flashinfer as fi

    original = fi.supports_trtllm_attention.__wrapped__
    original.cache_clear()
    return original(is_prefill=is_prefill)


@pytest.mark.parametrize("cap", [(9, 0), (12, 0), (12, 1)])
def test_offline_xqa_rank_decodes_with_xqa(rank, patched, cap, caplog):
    rank.cap = cap
    with caplog.at_level(logging.INFO, logger="vllm.dualgpu"):
        assert vllms(False) is False  # vLLM's answer offline: what the patch is for
        assert supports(False) is True
        assert supports(False) is True
    assert supports(True) is False  # prefill: vLLM's answer (no TRTLLM prefill there)
    lines = [r.getMessage() for r in caplog.records if "XQA" in r.getMessage()]
    sm = f"{cap[0]}.{cap[1]}"
    assert len(lines) == 1 and f"FlashInfer XQA decode on (SM {sm})" in lines[0], lines
    assert "vllm-dualgpu rank ?" in lines[0]  # no process group in this test


@pytest.mark.parametrize("cap", [(8, 9), (8, 0), (10, 0)])
def test_other_cards_keep_vllms_answer(rank, patched, cap, caplog):
    """SM 8.x has no XQA path; SM 10.x's trtllm-gen kernels are cubins (a real download)."""
    rank.cap = cap
    with caplog.at_level(logging.INFO, logger="vllm.dualgpu"):
        assert supports(False) is False and supports(True) is False
    assert not [r for r in caplog.records if "XQA" in r.getMessage()]


@pytest.mark.parametrize("cap", [(9, 0), (12, 0), (10, 0), (8, 9)])
def test_online_is_vllms_answer(rank, patched, cap, caplog):
    rank.cap, rank.online = cap, True
    with caplog.at_level(logging.INFO, logger="vllm.dualgpu"):
        for is_prefill in (False, True):
            assert supports(is_prefill) is vllms(is_prefill)
    assert supports(False) is (cap != (8, 9))
    assert not [r for r in caplog.records if "XQA" in r.getMessage()]


@pytest.mark.parametrize("nvcc,ninja", [(False, True), (True, False), (False, False)])
def test_no_jit_toolkit_keeps_vllms_false(rank, patched, nvcc, ninja):
    rank.toolkit(nvcc=nvcc, ninja=ninja)
    assert supports(False) is False


def test_batch_invariant_keeps_vllms_false(rank, patched, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert supports(False) is False


def test_answer_follows_the_current_device(rank, patched):
    """Asked at each call: a worker applies the patch before it sets its device."""
    rank.cap = (8, 9)
    assert supports(False) is False
    rank.cap = (9, 0)
    assert supports(False) is True


def test_backend_sees_it_and_the_users_false_still_wins(rank, patched, monkeypatch):
    import vllm.config.vllm
    import vllm.utils.flashinfer as fi
    from vllm.config import VllmConfig
    from vllm.config.attention import AttentionConfig

    backend = backend_module()
    if backend is None:
        pytest.skip("vLLM's FlashInfer backend does not import with a CPU-only torch on this release "
                    "(its FlashInfer asks the CUDA device at import)")

    assert backend.supports_trtllm_attention is fi.supports_trtllm_attention  # the copy, rebound
    fi.supports_trtllm_attention.__wrapped__.cache_clear()
    assert fi.can_use_trtllm_attention(32, 8, is_prefill=False) is True
    assert backend.FlashInferBackend.supports_sink() is True  # via the backend's copy
    assert fi.can_use_trtllm_attention(32, 8, is_prefill=True) is False
    users = VllmConfig(attention_config=AttentionConfig(use_trtllm_attention=False))
    monkeypatch.setattr(vllm.config.vllm, "_current_vllm_config", users)
    assert fi.can_use_trtllm_attention(32, 8, is_prefill=False) is False


def test_unpatched_vllm_turns_xqa_off_offline(rank, vllm_version):
    """What the patch is for: stock vLLM says no XQA decode on an offline SM 9.0 rank."""
    from _ported import unpatched

    import vllm.utils.flashinfer as fi

    with unpatched(_entry(vllm_version), vllm_version):
        fi.supports_trtllm_attention.cache_clear()
        assert fi.can_use_trtllm_attention(32, 8, is_prefill=False) is False
        fi.supports_trtllm_attention.cache_clear()


def test_other_source_is_skipped_before_anything_changes(rank, vllm_version):
    from _ported import unpatched

    import vllm.utils.flashinfer as fi
    from vllm_dualgpu.patching.core import SKIPPED, apply_patch

    backend = backend_module()
    other = dataclasses.replace(_entry(vllm_version), source_sha256="0" * 64)
    with unpatched(_entry(vllm_version), vllm_version):
        before = fi.supports_trtllm_attention
        out = apply_patch(other, vllm_version)
        assert out.status == SKIPPED and "not the one this patch was written against" in out.reason
        assert fi.supports_trtllm_attention is before
        assert backend is None or backend.supports_trtllm_attention is before
