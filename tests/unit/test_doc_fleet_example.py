"""docs/topologies.md quotes the output of ``vllm-dualgpu plan --fleet example`` in full. The
command, run by bash as the doc prints it (``vllm-dualgpu`` standing for this checkout's
``python -m vllm_dualgpu.cli``), prints exactly the quoted block: a planner change that moves a
number, or a changed line of the report, fails here until the doc is regenerated from the
command's output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "topologies.md"
COMMAND = "vllm-dualgpu plan --fleet example"

# `vllm-dualgpu` for the doc's command: this checkout's CLI, whatever is installed.
_SHIM = 'vllm-dualgpu() { "$PLAN_PYTHON" -m vllm_dualgpu.cli "$@"; }\n'


def quoted_output(text: str | None = None) -> str:
    """The fenced block that starts with the example's header line."""
    text = DOC.read_text() if text is None else text
    m = re.search(r"^```\n(vllm-dualgpu plan \(bundled example fleet-example\.json.*?)^```$", text,
                  re.S | re.M)
    assert m, "docs/topologies.md no longer quotes the bundled example's output"
    return m.group(1)


def run_as_printed() -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_DUALGPU_RESERVE", "VLLM_PP_LAYER_PARTITION", "VLLM_DUALGPU_OBJECTIVE")}
    env.update({"PLAN_PYTHON": sys.executable, "VLLM_DUALGPU_MACHINE_PROFILE": "none",
                "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])})
    return subprocess.run(["bash", "-c", _SHIM + COMMAND], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_doc_names_the_command():
    assert f"`{COMMAND}`" in DOC.read_text()


def test_the_bundled_example_prints_what_the_doc_quotes():
    p = run_as_printed()
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == quoted_output()


if __name__ == "__main__":  # the block as the CLI prints it now, to paste into the doc
    sys.stdout.write(run_as_printed().stdout)
