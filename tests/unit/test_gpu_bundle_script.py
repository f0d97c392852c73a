"""scripts/gpu/with_bundle.sh: a command's results folder packed while it runs and once it ends, so
a GPU call cut by its limit still returns its latest results in one file. Run through the shell."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "with_bundle.sh"


def names(bundle: Path) -> set[str]:
    with tarfile.open(bundle) as t:
        return {n.removeprefix("./") for n in t.getnames()} - {".", ""}


def test_the_bundle_follows_the_run_and_holds_its_last_files(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    bundle = out / "r1.tgz"
    cmd = f"mkdir -p {work}/logs && echo a > {work}/logs/first.log && sleep 3 && echo b > {work}/last.json && exit 3"
    p = subprocess.Popen(["bash", str(SCRIPT), str(bundle), str(work), "--", "bash", "-c", cmd],
                         env={**os.environ, "BUNDLE_EVERY": "1"})
    deadline = time.time() + 10
    while not bundle.exists() and time.time() < deadline:  # packed while the command still runs
        time.sleep(0.2)
    assert p.poll() is None and "logs/first.log" in names(bundle)
    assert p.wait(timeout=30) == 3  # the command's status
    assert {"logs/first.log", "last.json"} <= names(bundle)  # the last pack after it ended
    assert sorted(x.name for x in out.iterdir()) == ["r1.tgz"]  # no partial file left beside it


def test_a_cut_run_leaves_its_latest_bundle(tmp_path):
    """The call's limit ends the script (SIGKILL, as a machine's time limit does): the bundle
    packed before holds what was written by then."""
    out, work = tmp_path / "out", tmp_path / "work"
    bundle = out / "r2.tgz"
    p = subprocess.Popen(["bash", str(SCRIPT), str(bundle), str(work), "--", "bash", "-c",
                          f"echo x > {work}/arm.json; sleep 60"], env={**os.environ, "BUNDLE_EVERY": "1"},
                         start_new_session=True)
    deadline = time.time() + 10
    while not bundle.exists() and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(p.pid, 9)
    p.wait(timeout=10)
    assert "arm.json" in names(bundle)


def test_usage_errors_say_what_is_missing(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "b.tgz"), str(tmp_path / "w"), "true"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "expected -- before the command" in r.stderr


def test_cache_parts_come_back_beside_the_bundle(tmp_path):
    """A call returns files of at most 16 MiB: the caches' parts (caches.sh save, 15 MiB each) are
    not packed into the bundle but copied beside it, one file each."""
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "cache").mkdir(parents=True)
    for n in ("00", "01"):
        (work / "cache" / f"caches.tar.gz.{n}").write_bytes(n.encode() * 1000)
    (work / "arm.json").write_text("{}")
    r = subprocess.run(["bash", str(SCRIPT), str(out / "r3.tgz"), str(work), "--", "true"])
    assert r.returncode == 0
    assert sorted(x.name for x in out.iterdir()) == ["caches.tar.gz.00", "caches.tar.gz.01", "r3.tgz"]
    assert (out / "caches.tar.gz.01").read_bytes() == b"01" * 1000
    assert names(out / "r3.tgz") == {"arm.json", "cache"}
