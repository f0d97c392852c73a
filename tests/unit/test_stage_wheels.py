"""scripts/gpu/stage: the per-release wheel lists, the pack's wheel selection and the install's
unmet-requirement report (the parts that run without a GPU)."""

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

STAGE = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "stage"


def load(name):
    spec = importlib.util.spec_from_file_location(f"stage_{name}", STAGE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


select_wheels = load("select_wheels")
check_site = load("check_site")
LISTS = sorted(STAGE.glob("vllm-*.txt"))


def test_a_list_for_each_supported_release():
    assert {p.name for p in LISTS} >= {"vllm-0.30.0.txt", "vllm-0.33.0.txt"}


@pytest.mark.parametrize("path", LISTS, ids=lambda p: p.name)
def test_list_pins_its_vllm_once_and_leaves_out_what_it_says(path):
    release = path.name[len("vllm-"):-len(".txt")]
    lines = [l for l in path.read_text().splitlines() if l and not l.startswith("#")]
    names = [canonicalize_name(l.split("==")[0]) for l in lines]
    assert len(names) == len(set(names)), "a package is listed twice"
    assert f"vllm=={release}" in lines
    pins = select_wheels.read_pins(path)
    assert not set(pins) & check_site.not_carried(path), "listed and also marked not-carried"


def test_033_carries_torch_214_and_the_libraries_the_image_has_too_old():
    pins = {n: str(v) for n, v in select_wheels.read_pins(STAGE / "vllm-0.33.0.txt").items()}
    assert pins["torch"] == "2.14.0" and pins["torchvision"] == "0.29.0"
    assert pins["triton"].startswith("3.8.")  # torch 2.14.0 requires triton~=3.8.0; image 3.6.0
    assert pins["nvidia-nccl-cu13"] == "2.32.3"  # image 2.28.9; 2.30.7 is not on the index
    assert "openai-harmony" not in pins and "oss-harmony" in pins
    assert "transformers" not in pins  # the image's 5.17.0 is inside vLLM 0.33's range


def touch_wheels(folder, *names):
    for name in names:
        (folder / name).write_bytes(b"")


def run_select(list_path, cache):
    return subprocess.run([sys.executable, str(STAGE / "select_wheels.py"), str(list_path), str(cache)],
                          capture_output=True, text=True)


def test_select_takes_only_the_listed_versions(tmp_path):
    touch_wheels(tmp_path, "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl", "six-1.17.0-py3-none-any.whl")
    lst = tmp_path / "l.txt"
    lst.write_text("# comment\ntorch==2.14.0\npydantic-core==2.50.5  # note\n")
    done = run_select(lst, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl",
                                   "torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl"]


def test_select_refuses_a_missing_or_doubled_wheel(tmp_path):
    touch_wheels(tmp_path, "six-1.17.0-py3-none-any.whl", "six-1.17.0-py2.py3-none-any.whl")
    lst = tmp_path / "l.txt"
    lst.write_text("six==1.17.0\ntriton==3.8.0\n")
    done = run_select(lst, tmp_path)
    assert done.returncode == 1
    assert "no wheel for triton==3.8.0" in done.stderr
    assert "several wheels for six" in done.stderr


def test_select_refuses_an_unpinned_line(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("torch>=2.14\n")
    done = run_select(lst, tmp_path)
    assert done.returncode != 0 and "pin every wheel exactly" in done.stderr


def fake_dist(site, name, version, *requires):
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_unmet_requirements_names_what_neither_site_nor_image_meets(tmp_path, monkeypatch):
    site = tmp_path / "site"
    fake_dist(site, "staged", "1.0", "dep-lib>=2", "absent-lib", "skipped-lib",
              "pytest>=1", "pytest<1", "win-only; sys_platform == 'win32'", "extra-only; extra == 'x'")
    fake_dist(site, "dep_lib", "1.5")
    monkeypatch.syspath_prepend(str(site))
    unmet = {(name, req): have for name, req, have in check_site.unmet_requirements(str(site), {"skipped-lib"})}
    assert unmet == {("staged", "dep-lib>=2"): "1.5", ("staged", "absent-lib"): None,
                     ("staged", "pytest<1"): pytest.__version__}


def test_not_carried_reads_every_marked_line(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("# not-carried: Tilelang nvidia_cutlass_dsl\n# other\n# not-carried: torchcodec\nvllm==1\n")
    assert check_site.not_carried(lst) == {"tilelang", "nvidia-cutlass-dsl", "torchcodec"}


def run_install(gdir):
    return subprocess.run(["bash", str(STAGE / "install.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GPUKIT_DIR": str(gdir)})


def write_parts(gdir, release, data, part_size, sha=None):
    gdir.mkdir(exist_ok=True)
    chunks = [data[i:i + part_size] for i in range(0, len(data), part_size)]
    for i, chunk in enumerate(chunks):
        (gdir / f"part.{i:02d}").write_bytes(chunk)
    sha = sha or hashlib.sha256(data).hexdigest()
    (gdir / "MANIFEST").write_text(f"release={release}\nparts={len(chunks)}\nsha256={sha}\n")
    return len(chunks)


def test_install_refuses_without_manifest(tmp_path):
    done = run_install(tmp_path)
    assert done.returncode == 2 and "no " in done.stderr and "MANIFEST" in done.stderr


def test_install_names_the_missing_parts(tmp_path):
    n = write_parts(tmp_path, "0.33.0", b"x" * 10, 3)
    assert n == 4
    (tmp_path / "part.01").unlink()
    (tmp_path / "part.03").unlink()
    done = run_install(tmp_path)
    assert done.returncode == 2 and "p01 p03" in done.stderr


def test_install_refuses_damaged_parts_and_unknown_release(tmp_path):
    write_parts(tmp_path, "0.33.0", b"abcdef", 4, sha="0" * 64)
    done = run_install(tmp_path)
    assert done.returncode == 2 and "checksum" in done.stderr
    write_parts(tmp_path / "other", "9.9.9", b"abcdef", 4)
    done = run_install(tmp_path / "other")
    assert done.returncode == 2 and "vllm-9.9.9.txt" in done.stderr
