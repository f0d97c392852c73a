"""The check of a release's sources passes on the installed vLLM's tree (copies, overrides,
interventions included), as scripts/test.sh runs it for each release."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from vllm_dualgpu.patching.static_check import main


def test_the_installed_release_has_no_unreached_copy_or_override(capsys):
    spec = importlib.util.find_spec("vllm")  # located, not imported
    tree = Path(spec.origin).parent.parent
    version = importlib.metadata.version("vllm")
    assert main(["--vllm-tree", str(tree), "--version", version]) == 0, capsys.readouterr().out
    assert " in-range entries match" in capsys.readouterr().out
