"""scripts/gpu/caches.sh through the shell: compile caches saved in parts and put back."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "caches.sh"


def run(*args: str, home: Path, inductor: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "TORCHINDUCTOR_CACHE_DIR": str(inductor), **extra}
    for var in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE"):
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


def test_parts_are_gzip_which_every_machine_unpacks(tmp_path):
    """The GPU machines have gzip but no zstd: a zstd part saved elsewhere did not load there."""
    home, inductor, out = tmp_path / "home", tmp_path / "inductor", tmp_path / "out"
    (home / ".triton" / "cache").mkdir(parents=True)
    (home / ".triton" / "cache" / "k.bin").write_bytes(b"kernel")
    saved = run("save", str(out), home=home, inductor=inductor)
    assert saved.returncode == 0, saved.stderr
    assert [p.name for p in out.iterdir()] == ["caches.tar.gz.00"]


def test_zstd_parts_without_zstd_are_refused_in_one_line(tmp_path):
    """Loading zstd parts where zstd is missing says so and fails, instead of tar's noise."""
    part = tmp_path / "parts" / "caches.tar.zst.00"
    part.parent.mkdir()
    part.write_bytes(b"\x28\xb5\x2f\xfd not really")
    bin_dir = tmp_path / "bin"  # a PATH with the tools the script needs, and no zstd
    bin_dir.mkdir()
    for tool in ("bash", "cat", "tar", "ls", "gzip", "wc", "split", "stat", "rm", "mkdir"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (bin_dir / tool).symlink_to(found)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PATH": str(bin_dir)}
    r = subprocess.run([str(bin_dir / "bash"), str(SCRIPT), "load", str(part.parent)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [f"caches.sh: {part.parent} holds zstd parts and zstd is not installed: "
                                             "install zstd, or save the caches again (saves are gzip now)"]


def test_vllms_compile_cache_is_kept_before_flashinfers_builds_when_the_caches_are_too_big(tmp_path):
    """Over the size limit, Inductor's folder goes first, then FlashInfer's JIT builds, and vLLM's
    compile cache with Triton's stays. Measured: vLLM's compile cache took a W8A16 + DFlash2 boot
    from 318 s to 103 s (fifteenth session), while FlashInfer's three fp8-KV modules are rebuilt
    in ~170 s by scripts/gpu/prebuild_flashinfer.py in the background, off the arms' path; an 82
    MiB save (sixteenth session) did not come back whole."""
    home, inductor, out = tmp_path / "home", tmp_path / "inductor", tmp_path / "out"
    built = home / ".cache" / "flashinfer" / "0.7.2" / "90" / "cached_ops" / "prefill" / "prefill.so"
    compiled = home / ".cache" / "vllm" / "torch_compile_cache" / "abc" / "rank_0_0" / "model.bin"
    big = inductor / "big.bin"
    for f, n in ((built, 5 * 2**19), (compiled, 6 * 10**5), (home / ".triton" / "cache" / "k.bin", 100),
                 (big, 3 * 2**20)):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(os.urandom(n))
    original = compiled.read_bytes()
    saved = run("save", str(out), home=home, inductor=inductor, CACHES_MAX_MIB="1")
    assert saved.returncode == 0, saved.stderr
    assert saved.stderr.count("trying less") == 2, saved.stderr  # all, then without Inductor's
    for d in (home, inductor):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    loaded = run("load", str(out), home=home, inductor=inductor)
    assert loaded.returncode == 0, loaded.stderr
    assert compiled.read_bytes() == original and (home / ".triton" / "cache" / "k.bin").exists()
    assert not built.exists() and not big.exists()
