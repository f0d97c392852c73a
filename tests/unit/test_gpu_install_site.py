"""scripts/gpu/install_site.sh: run.sh installs this checkout next to the staged vLLM once per
source tree, and run.sh calls started side by side (a soak beside the tests, as on 2026-12-03)
wait for the first one's install instead of installing into the same folder at once. Through the
shell, with a stand-in ``python3`` first on PATH that records each pip call and takes a second."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "install_site.sh"

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is not installed")

FAKE_PYTHON = """#!/bin/sh
echo "$@" >> "$CALLS"
sleep 1
"""


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}


def start(site: Path, log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), str(site), str(log)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def pip_calls(env: dict) -> list[str]:
    path = Path(env["CALLS"])
    return path.read_text().splitlines() if path.exists() else []


def test_side_by_side_calls_install_once(tmp_path, env):
    site = tmp_path / "site"
    procs = [start(site, tmp_path / f"install{i}.log", env) for i in range(3)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    calls = pip_calls(env)
    assert len(calls) == 1 and calls[0].startswith("-m pip install") and f"--target {site}" in calls[0], calls
    assert len((site / ".source-hash").read_text().strip()) == 16


def test_an_installed_tree_is_not_reinstalled_and_a_changed_one_is(tmp_path, env):
    site = tmp_path / "site"
    assert start(site, tmp_path / "a.log", env).wait(60) == 0
    assert start(site, tmp_path / "b.log", env).wait(60) == 0
    assert len(pip_calls(env)) == 1
    (site / ".source-hash").write_text("0000000000000000\n")  # another tree's install
    assert start(site, tmp_path / "c.log", env).wait(60) == 0
    assert len(pip_calls(env)) == 2


def test_a_failed_install_says_why_and_records_nothing(tmp_path, env):
    (Path(env["PATH"].split(":")[0]) / "python3").write_text('#!/bin/sh\necho "error: no wheel for you"\nexit 1\n')
    site = tmp_path / "site"
    p = start(site, tmp_path / "install.log", env)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 1 and "error: no wheel for you" in out, out
    assert not (site / ".source-hash").exists()
