"""Registry patch ``executor-help``: vLLM's help for --distributed-executor-backend names dualgpu."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_dualgpu.patching.core import revert_patch
from vllm_dualgpu.patching.registry import PATCHES

PATCH = next(p for p in PATCHES if p.name == "executor-help")


def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def _help(parser) -> str:
    return parser._option_string_actions["--distributed-executor-backend"].help


def test_help_names_dualgpu_and_parsing_is_unchanged():
    from conftest import apply_registry_patch
    from vllm.version import __version__

    revert_patch(PATCH)
    stock = _help(_parser())
    assert "dualgpu" not in stock
    apply_registry_patch("executor-help", __version__)
    try:
        parser = _parser()
        text = _help(parser)
        assert text.startswith(stock.rstrip()) and "'dualgpu'" in text and "vllm-dualgpu plan" in text
        # applied twice and called twice: one sentence, not two
        apply_registry_patch("executor-help", __version__)
        assert _help(_parser()).count("'dualgpu'") == 1
        args = parser.parse_args(["--distributed-executor-backend", "dualgpu"])
        assert args.distributed_executor_backend == "dualgpu"
    finally:
        revert_patch(PATCH)
    assert "dualgpu" not in _help(_parser())


@pytest.mark.slow
def test_vllm_serve_help_mentions_dualgpu(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help=distributed-executor-backend"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**__import__("os").environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'dualgpu' runs pipeline" in " ".join(out.stdout.split())
