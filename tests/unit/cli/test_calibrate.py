"""`vllm-dualgpu calibrate` with the GPUs and the measuring faked (no GPU on CI): it writes the
machine profile and prints one table row per GPU; its refusals are one line."""

from __future__ import annotations

import json

import pytest

from vllm_dualgpu import bandwidth_probe, nvml
from vllm_dualgpu.cli import main
from vllm_dualgpu.envs import MACHINE_PROFILE
from vllm_dualgpu.nvml import VisibleGpu

GiB = 1024**3
SEEN = [
    VisibleGpu(0, "NVIDIA GeForce RTX 5090", 32 * GiB, 31 * GiB, (12, 0), 1792.0, "GPU-aaaa",
               pci_bus_id="00000000:01:00.0"),
    VisibleGpu(1, "NVIDIA Mystery Card", 16 * GiB, 15 * GiB, (8, 9), 500.0, "GPU-bbbb",
               pci_bus_id="00000000:02:00.0"),
]
# what the fake measures: (read, copy) GB/s per CUDA index
FAKE = {0: (1523.4, 1401.0), 1: (400.0, 380.0)}


@pytest.fixture
def fake_gpus(monkeypatch):
    asked = []

    def measure(device, seconds, progress=None):
        asked.append((device, seconds))
        if progress:
            progress(seconds)
        return bandwidth_probe.Measured(*FAKE[device], buffer_bytes=GiB)

    monkeypatch.setattr(nvml, "read_visible_gpus", lambda: SEEN)
    monkeypatch.setattr(bandwidth_probe, "measure", measure)
    return asked


def test_writes_the_profile_and_prints_the_table(fake_gpus, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", "--output", str(out), "--seconds", "2"]) == 0
    assert fake_gpus == [(0, 2.0), (1, 2.0)]
    data = json.loads(out.read_text())
    assert data["schema"] == 1 and data["created"].endswith("+00:00")
    assert data["vllm"] and data["torch"]  # this environment has both
    gpus = data["gpus"]
    assert [g["uuid"] for g in gpus] == ["GPU-aaaa", "GPU-bbbb"]
    assert [g["pci_bus_id"] for g in gpus] == ["00000000:01:00.0", "00000000:02:00.0"]
    assert [g["total_bytes"] for g in gpus] == [32 * GiB, 16 * GiB]
    # datasheet: the table's 1,792 for the 5090; NVML's peak for a card the table lacks
    assert [g["datasheet_gbps"] for g in gpus] == [1792, 500.0]
    assert [(g["read_gbps"], g["copy_gbps"]) for g in gpus] == [(1523.4, 1401.0), (400.0, 380.0)]
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines()]
    assert ["0", "NVIDIA", "GeForce", "RTX", "5090", "1,792", "1,523", "1,401", "0.85"] in rows
    assert ["1", "NVIDIA", "Mystery", "Card", "500", "400", "380", "0.80"] in rows
    assert f"Wrote {out}" in text


def test_default_path_is_the_xdg_cache(fake_gpus, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(MACHINE_PROFILE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["calibrate", "--seconds", "1", "--no-progress"]) == 0
    assert json.loads((tmp_path / "vllm-dualgpu" / "machine-profile.json").read_text())["gpus"][0]["uuid"] == "GPU-aaaa"


@pytest.mark.parametrize("argv,code,says", [
    (["--seconds", "0"], 2, "--seconds 0: give a positive number"),
])
def test_bad_arguments_are_one_line(fake_gpus, tmp_path, capsys, argv, code, says):
    assert main(["calibrate", "--output", str(tmp_path / "p.json"), *argv]) == code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and says in err and "Traceback" not in err


def test_no_gpu_and_a_failed_measurement_are_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(nvml, "read_visible_gpus", lambda: [])
    assert main(["calibrate", "--output", str(tmp_path / "p.json")]) == 1
    assert "NVML sees no GPU" in capsys.readouterr().err

    def broken(device, seconds, progress=None):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(nvml, "read_visible_gpus", lambda: SEEN)
    monkeypatch.setattr(bandwidth_probe, "measure", broken)
    assert main(["calibrate", "--output", str(tmp_path / "p.json"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "vllm-dualgpu calibrate: GPU 0 (NVIDIA GeForce RTX 5090): cannot measure (RuntimeError: CUDA out of memory)"
    assert not (tmp_path / "p.json").exists()


def test_buffer_is_a_gib_at_most_and_an_eighth_of_free():
    assert bandwidth_probe.buffer_bytes(100 * GiB) == GiB
    assert bandwidth_probe.buffer_bytes(4 * GiB) == GiB // 2
    assert bandwidth_probe.buffer_bytes(0) == 2 << 20
