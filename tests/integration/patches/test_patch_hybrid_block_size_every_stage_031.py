"""hybrid-block-size-every-stage-031 (vLLM 0.31). Its factory is the 0.32+ entry's, which runs
on vLLM 0.33 here; 0.31's pinned source is checked by scripts/test.sh's static checks."""

from __future__ import annotations

from _hybrid_plural import check_entry, plural_finder_required
from _ported import entry


def test_entry(vllm_version, qwen3_5_hybrid_config):
    check_entry("hybrid-block-size-every-stage-031", vllm_version, qwen3_5_hybrid_config)


def test_shares_the_plural_factory():
    assert entry("hybrid-block-size-every-stage-031").factory == entry(
        "hybrid-block-size-every-stage-032").factory


def test_plural_factory_answers_a_list(vllm_version):
    """The finder stand-in answers [backend] (0.31+ takes a list and its first element)."""
    plural_finder_required()
    from vllm.platforms.interface import Platform

    from vllm_dualgpu.patches.platforms_interface import PLURAL, _stage_backend

    sentinel = object()
    with _stage_backend(Platform, sentinel, PLURAL):
        assert Platform._find_non_ssm_backends(None) == [sentinel]
    assert "_find_non_ssm_backends" in vars(Platform)  # vLLM's own is back
