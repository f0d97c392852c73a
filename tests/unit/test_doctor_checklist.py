"""``vllm-dualgpu doctor`` as a checklist: a fix: line under each failure, exit 1 when the
dualgpu path cannot work here, a progress line before the slow import, the torchvision::nms
failures as one line with the fix, and the GPUs in plan's --gpus syntax (issue 17, item 4)."""

from __future__ import annotations

import pytest

from vllm_dualgpu._version import SUPPORTED_VLLM
from vllm_dualgpu.cli import doctor, main
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.patching import core, registry
from vllm_dualgpu.patching.core import READY, SKIPPED, Outcome, Patch
from vllm_dualgpu.planner import parse_gpus

GiB = 1024**3
BIG = VisibleGpu(physical_id=0, name="NVIDIA GeForce RTX 5090", total_bytes=32 * GiB,
                 free_bytes=30 * GiB, capability=(12, 0), bandwidth_gbps=1792.0, uuid="GPU-a")
SMALL = VisibleGpu(physical_id=1, name="NVIDIA GeForce RTX 4070 Ti SUPER", total_bytes=16 * GiB,
                   free_bytes=15 * GiB, capability=(8, 9), bandwidth_gbps=672.0, uuid="GPU-b")
NMS = "target vllm.model_executor.models.x:Y not found: operator torchvision::nms does not exist"


def _patch(name, target="vllm.model_executor.models.x:Y"):
    return Patch(name=name, target=target, processes=("worker",), vllm_versions=SUPPORTED_VLLM,
                 why="w", upstream="u", remove_when="r", factory="m:f", params=())


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.delenv("VLLM_DUALGPU_RESERVE", raising=False)


@pytest.fixture
def gpus(monkeypatch):
    import vllm_dualgpu.nvml

    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", lambda: [BIG, SMALL])


@pytest.fixture
def nms_patches(monkeypatch):
    patches = tuple(_patch(f"p{i}") for i in range(15)) + (_patch("fine"),)

    def fake_check(p, version):
        if p.name == "fine":
            return Outcome(p, READY, "")
        return Outcome(p, SKIPPED, NMS)

    monkeypatch.setattr(registry, "PATCHES", patches)
    monkeypatch.setattr(core, "check_patch", fake_check)


def test_torchvision_failures_are_one_line_with_the_fix(gpus, nms_patches, capsys):
    assert main(["doctor"]) == 1
    out, err = capsys.readouterr()
    assert out.count("torchvision::nms") == 1
    (line,) = [x for x in out.splitlines() if "torchvision::nms" in x]
    assert line.split()[:3] == ["failed", "15", "patches"]
    assert "pip uninstall -y torchvision torchaudio torchcodec" in out
    assert "applies  fine" in out


def test_progress_line_before_the_slow_import(gpus, nms_patches, capsys):
    main(["doctor"])
    err = capsys.readouterr().err
    assert err.startswith("vllm-dualgpu doctor: importing vLLM")


def test_gpus_as_plan_sees_them(gpus, capsys):
    lines, facts = doctor.gpu_lines()
    (line,) = [x for x in lines if "as plan --gpus local sees them" in x]
    spec = line.split("--gpus ", 2)[2].strip("'")
    parsed = parse_gpus(spec)
    assert [g.name for g in parsed] == [BIG.name, SMALL.name]
    assert [g.total_bytes for g in parsed] == [BIG.total_bytes, SMALL.total_bytes]
    assert [g.free_bytes for g in parsed] == [BIG.free_bytes, SMALL.free_bytes]
    assert [g.reserve_bytes for g in parsed] == [GiB, GiB]  # the executor's default reserve


def test_no_gpu_fails_with_the_fix(monkeypatch, capsys):
    import vllm_dualgpu.nvml

    def none():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", none)
    monkeypatch.setattr(registry, "PATCHES", (_patch("cuda", "vllm.platforms.cuda:X.y"),))
    monkeypatch.setattr(core, "check_patch", lambda p, v: Outcome(p, SKIPPED, "libcuda.so.1"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(n for n, x in enumerate(lines) if x.startswith("GPUs: none visible"))
    assert lines[i + 1].startswith("  fix: ") and "vllm-dualgpu plan --gpus" in lines[i + 1]
    assert lines[-1].startswith("Result: the dualgpu path cannot work here (no GPU)")


def test_unsupported_vllm_fails_with_the_install_command(gpus, monkeypatch, capsys):
    from vllm_dualgpu import support

    monkeypatch.setattr(support, "installed_vllm_version", lambda: "0.29.0")
    monkeypatch.setattr(registry, "PATCHES", ())
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "  fix: " in out and "pip install 'vllm" in out


def test_a_ready_machine_exits_0(gpus, monkeypatch, capsys):
    monkeypatch.setattr(registry, "PATCHES", (_patch("fine"),))
    monkeypatch.setattr(core, "check_patch", lambda p, v: Outcome(p, READY, ""))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "fix:" not in out and out.rstrip().endswith("Result: ready for --distributed-executor-backend dualgpu")
