"""dualgpu-needs-supported-vllm: outside the supported range, 'dualgpu' is refused at argument
time with the support message, and nothing else changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _ported import entry

NAME = "dualgpu-needs-supported-vllm"
FIXTURES = Path(__file__).parents[2] / "fixtures"


def test_range_is_the_complement_of_the_supported_one():
    from vllm_dualgpu._version import SUPPORTED_VLLM
    from vllm_dualgpu.patching.core import version_in_range

    for v in ("0.29.9", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.33.1", "0.34.0", "0.35.0", "1.0.0",
              # pre-releases, development builds, post-releases and local builds
              "0.30.0rc2", "0.34.0rc1", "0.34.0.dev3", "0.29.0rc1", "0.33.1.dev12+g0123abc",
              "0.33.0.post1", "0.33.0+cu128", "0.34.0+cu128", "0.35.0rc1", "0.35.0+cu128", "0.30.0.dev0"):
        assert version_in_range(v, entry(NAME).vllm_versions) != version_in_range(v, SUPPORTED_VLLM), v


@pytest.mark.parametrize("version, supported", [
    ("0.30.0rc2", False), ("0.35.0rc1", False), ("0.35.0.dev3", False), ("0.30.0", True),
    ("0.33.1.dev12+g0123abc", True), ("0.33.0.post1", True), ("0.33.0+cu128", True),
])
def test_support_of_pre_dev_post_and_local_versions(version, supported):
    from vllm_dualgpu import support

    assert support.is_supported(version) is supported
    assert (support.unsupported_reason(version) is None) is supported


@pytest.fixture
def unsupported(vllm_version, monkeypatch, tmp_path):
    """The guard applied as on vLLM 0.35.0 (the installed vLLM's class, which it checks)."""
    from vllm_dualgpu import support
    from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch

    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    # The plugin runs in this process (for the supported vLLM) before the method is swapped, so
    # it cannot wrap the guard; then vLLM's own method stands in for the unsupported release's.
    load_general_plugins()
    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.35.0")
    patch = entry(NAME)

    own = getattr(EngineArgs.create_engine_config, "__wrapped__", EngineArgs.create_engine_config)
    monkeypatch.setattr(EngineArgs, "create_engine_config", own)
    assert apply_patch(patch, "0.35.0").status == APPLIED
    shutil.copy(FIXTURES / "tiny_qwen3.json", tmp_path / "config.json")
    yield tmp_path
    revert_patch(patch)


def test_dualgpu_is_refused_with_the_support_message(unsupported):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(unsupported), load_format="dummy", skip_tokenizer_init=True,
                      pipeline_parallel_size=2, distributed_executor_backend="dualgpu")
    with pytest.raises(ValueError) as err:
        args.create_engine_config()
    msg = str(err.value)
    assert msg.startswith("--distributed-executor-backend dualgpu: vllm-dualgpu")
    assert "supports vLLM >=0.30.0,<0.35, found 0.35.0" in msg and "pip install" in msg
    assert "Pipeline Parallelism" not in msg


def test_other_backends_are_untouched(unsupported):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(unsupported), load_format="dummy", skip_tokenizer_init=True,
                      distributed_executor_backend="mp")
    assert args.create_engine_config().parallel_config.distributed_executor_backend == "mp"
