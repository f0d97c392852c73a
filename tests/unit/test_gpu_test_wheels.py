"""scripts/gpu/test_wheels.sh install: pytest for the GPU host from uploaded wheels.

The host's staging brings no pytest, so scripts/gpu/run.sh installs it from a folder of wheels.
These tests use a virtual environment without pytest (but with pip) and small wheels written
here under the real distribution names, so nothing is downloaded.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "test_wheels.sh"
DISTS = ("pytest", "pytest_timeout", "pluggy", "iniconfig", "packaging", "pygments")


def make_wheel(folder: Path, dist: str, version: str = "0.0.1") -> Path:
    """A minimal pure-Python wheel: module ``dist`` with ``__version__`` and its dist-info."""
    info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A Python with pip but without pytest (a fresh virtual environment)."""
    env_dir = tmp_path_factory.mktemp("bare") / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", str(env_dir)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"cannot create a virtual environment with pip: {r.stderr.strip()[-200:]}")
    py = str(env_dir / "bin" / "python")
    assert subprocess.run([py, "-c", "import pytest"], capture_output=True).returncode != 0
    return py


def install(python: str, wheels: Path, site: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FIND_LINKS", "PIP_INDEX_URL")}
    env.update(PYTHON=python, DUALGPU_SITE=str(site), PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(["bash", str(SCRIPT), "install", str(wheels)], env=env, capture_output=True,
                          text=True, timeout=180)


def test_installs_each_missing_wheel_into_the_site(tmp_path, bare_python):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist in DISTS:
        make_wheel(wheels, dist)
    site = tmp_path / "site"
    r = install(bare_python, wheels, site)
    assert r.returncode == 0, r.stdout + r.stderr
    for dist in DISTS:
        assert f"{dist}: installed {dist}-0.0.1-py3-none-any.whl" in r.stdout
        assert (site / dist / "__init__.py").exists()
    assert f"pytest 0.0.1 from {site}" in r.stdout  # the staged Python now imports it from SITE
    again = install(bare_python, wheels, site)  # a second run finds everything importable
    assert again.returncode == 0 and again.stdout.count("already importable") == len(DISTS), again.stdout


def test_a_missing_wheel_is_named(tmp_path, bare_python):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist in DISTS[:-1]:
        make_wheel(wheels, dist)
    r = install(bare_python, wheels, tmp_path / "site")
    assert r.returncode == 2
    assert f"{DISTS[-1]} is not importable and {wheels} has no wheel for it" in r.stderr


def test_what_the_host_has_is_left_alone(tmp_path):
    """With every module importable (this interpreter has pytest), nothing is installed."""
    site = tmp_path / "site"
    r = install(sys.executable, tmp_path, site)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("already importable") == len(DISTS)
    assert not any(site.iterdir())


def test_a_missing_folder_says_how_to_make_it(tmp_path):
    r = install(sys.executable, tmp_path / "nowhere", tmp_path / "site")
    assert r.returncode == 2 and "test_wheels.sh pack" in r.stderr
