"""scripts/gpu/caches.sh through the shell: compile caches saved in parts and put back."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "caches.sh"


def run(*args: str, home: Path, inductor: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    for var in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"):
        env.pop(var, None)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def test_saved_caches_come_back_on_a_fresh_home(tmp_path):
    home, inductor, out = tmp_path / "home", tmp_path / "inductor", tmp_path / "out"
    kernel = home / ".triton" / "cache" / "abc" / "kernel.cubin"
    graph = home / ".cache" / "vllm" / "torch_compile_cache" / "g" / "graph.py"
    for f, data in ((kernel, os.urandom(3000)), (graph, b"compiled = True\n")):
        f.parent.mkdir(parents=True)
        f.write_bytes(data)
    inductor.mkdir()
    (inductor / "k.py").write_text("x = 1\n")
    saved = run("save", str(out), "1", home=home, inductor=inductor)
    assert saved.returncode == 0, saved.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert parts and all(p.startswith(("caches.tar.zst.", "caches.tar.gz.")) for p in parts)
    original = kernel.read_bytes()
    for d in (home, inductor):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    loaded = run("load", str(out), home=home, inductor=inductor)
    assert loaded.returncode == 0, loaded.stderr
    assert kernel.read_bytes() == original
    assert graph.read_text() == "compiled = True\n"
    assert (inductor / "k.py").read_text() == "x = 1\n"


def test_load_without_parts_changes_nothing(tmp_path):
    r = run("load", str(tmp_path), home=tmp_path / "home", inductor=tmp_path / "ind")
    assert r.returncode == 0 and "no parts" in r.stdout
    assert not (tmp_path / "home").exists()


def test_an_unknown_verb_is_refused(tmp_path):
    r = run("keep", str(tmp_path), home=tmp_path, inductor=tmp_path / "ind")
    assert r.returncode == 2 and "unknown verb keep" in r.stderr
