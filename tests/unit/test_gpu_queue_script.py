"""scripts/gpu/queue.sh: a queue of GPU runs started once and detached, waited on by later calls
for at most their own time, its run folder brought back in one file. Run through the shell, with a
stand-in staging environment and commands that take seconds."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "queue.sh"


def queue_sh(*args, env_file: Path | None = None, timeout=60):
    env = {**os.environ, "BUNDLE_EVERY": "1"}
    if env_file is not None:
        env["STAGING_ENV"] = str(env_file)
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def names(bundle: Path) -> set[str]:
    with tarfile.open(bundle) as t:
        return {n.removeprefix("./") for n in t.getnames()} - {".", ""}


def staged(tmp_path: Path) -> Path:
    env = tmp_path / "env.sh"
    env.write_text("export STAGED_MARK=staged\n")
    return env


def test_a_queue_runs_in_order_past_a_failing_line_and_the_wait_reports_it(tmp_path):
    queue, run, bundle = tmp_path / "q.txt", tmp_path / "run", tmp_path / "out" / "r1.tgz"
    queue.write_text("# the staged environment is sourced, RUN names the run folder\n"
                     "echo $STAGED_MARK > $RUN/one.txt\n"
                     "\n"
                     "sleep 1; exit 4\n"
                     "pwd > $RUN/three.txt\n")
    t0 = time.time()
    r = queue_sh("start", queue, run, env_file=staged(tmp_path))
    assert r.returncode == 0, r.stderr
    assert time.time() - t0 < 5 and "started 3 line(s)" in r.stdout  # detached: start returns at once
    w = queue_sh("wait", run, 30, bundle)
    assert w.returncode == 1, w.stdout + w.stderr  # ended, one line failed
    status = (run / "queue" / "status").read_text().splitlines()
    assert [s.split(":")[0].split(" s=")[0] for s in status] == ["01 rc=0", "02 rc=4", "03 rc=0"]
    assert (run / "one.txt").read_text().strip() == "staged"
    assert (run / "three.txt").read_text().strip() == str(SCRIPT.parents[2])  # the checkout's root
    assert {"one.txt", "three.txt", "queue/status", "queue/done", "queue/02.log"} <= names(bundle)
    assert "02 rc=4" in w.stdout


def test_a_wait_shorter_than_the_queue_returns_124_and_a_later_wait_finds_it_running(tmp_path):
    queue, run = tmp_path / "q.txt", tmp_path / "run"
    queue.write_text("echo first; sleep 4\necho second > $RUN/second.txt\n")
    t0 = time.time()
    w = queue_sh("run", queue, run, 1, tmp_path / "r1.tgz", env_file=staged(tmp_path))
    assert w.returncode == 124 and time.time() - t0 < 8, w.stdout + w.stderr
    assert "still running: 01 started" in w.stdout and "first" in w.stdout  # the running line's log
    again = queue_sh("start", queue, run, env_file=staged(tmp_path))
    assert again.returncode == 2 and "already running" in again.stderr  # no second runner
    w2 = queue_sh("wait", run, 30, tmp_path / "r2.tgz")
    assert w2.returncode == 0, w2.stdout + w2.stderr
    assert "second.txt" in names(tmp_path / "r2.tgz")


def test_a_fresh_machine_neither_waits_nor_starts(tmp_path):
    """The lesson of a lost machine: a wait meant for the previous call's machine ends at once."""
    t0 = time.time()
    w = queue_sh("wait", tmp_path / "run", 500, tmp_path / "r.tgz")
    assert w.returncode == 3 and time.time() - t0 < 5
    assert "no queue in" in w.stderr and "fresh machine" in w.stderr
    queue = tmp_path / "q.txt"
    queue.write_text("true\n")
    s = queue_sh("start", queue, tmp_path / "run", env_file=tmp_path / "absent-env.sh")
    assert s.returncode == 3 and "no staged vLLM here" in s.stderr
    assert not (tmp_path / "run").exists()


def test_usage_errors(tmp_path):
    assert queue_sh("wait", tmp_path).returncode == 2
    r = queue_sh("wait", tmp_path, "soon", tmp_path / "b.tgz")
    assert r.returncode == 2 and "whole number" in r.stderr
    assert queue_sh("launch").returncode == 2
