"""tests/gpu holds only tests that need a GPU: with the ``gpu`` marker deselected, nothing there
is left to run (the GPU harness modules' own CPU tests live in tests/unit/gpu_support)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_in_tests_gpu_is_marked_gpu():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "not gpu", "tests/gpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    out = run.stdout + run.stderr
    collected = [line for line in out.splitlines() if "::" in line]
    assert not collected, "tests in tests/gpu that need no GPU:\n" + "\n".join(collected)
    assert "deselected" in out, out
