"""`plan --profile`: a machine profile's measured read bandwidths replace the datasheet figures
in the decode estimate, by the ratio the hand-written figures give; plan says which profile it
used; `--profile none` (or no profile at all) prints what plan printed before."""

from __future__ import annotations

import json

import pytest

from vllm_dualgpu.cli import main
from vllm_dualgpu.envs import MACHINE_PROFILE

GPUS = "RTX 5090,RTX 4070 Ti SUPER"
# Datasheet (planner/gpus.py's table, the vendors' figures): RTX 5090 1,792 GB/s, 4070 Ti SUPER 672.
DATASHEET = {"RTX 5090": 1792.0, "RTX 4070 Ti SUPER": 672.0}
MEASURED = {"RTX 5090": 1344.0, "RTX 4070 Ti SUPER": 420.0}
PROFILE = {
    "schema": 1, "created": "2026-05-01T10:00:00+00:00", "torch": "2.9.0", "vllm": "0.33.0",
    "gpus": [
        {"uuid": "GPU-aaaa", "name": "NVIDIA GeForce RTX 5090", "pci_bus_id": "00000000:01:00.0",
         "total_bytes": 34190917632, "datasheet_gbps": 1792, "read_gbps": MEASURED["RTX 5090"], "copy_gbps": 1300.0},
        {"uuid": "GPU-bbbb", "name": "NVIDIA GeForce RTX 4070 Ti SUPER", "pci_bus_id": "00000000:02:00.0",
         "total_bytes": 17171480576, "datasheet_gbps": 672, "read_gbps": MEASURED["RTX 4070 Ti SUPER"], "copy_gbps": 400.0},
    ],
}
FIXED = ["--layer-partition", "17,47", "--gpu-order", "1,0"]  # the same split with and without


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "machine-profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", "--gpus", GPUS, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_measured_bandwidth_scales_each_ranks_decode_time(capsys, profile_file):
    before = plan_json(capsys, *FIXED)
    after = plan_json(capsys, *FIXED, "--profile", str(profile_file))
    names = [r["gpu"]["name"] for r in after["plan"]["ranks"]]
    assert names == ["RTX 4070 Ti SUPER", "RTX 5090"]
    for b, a, name in zip(before["plan"]["ranks"], after["plan"]["ranks"], names):
        assert a["gpu"]["bandwidth_gbps"] == MEASURED[name]
        # same bytes read, over the measured instead of the datasheet bandwidth
        assert a["decode_read_bytes"] == b["decode_read_bytes"]
        assert a["predicted_decode_ms"] / b["predicted_decode_ms"] == pytest.approx(DATASHEET[name] / MEASURED[name])
    # the step: each rank's read bytes over its measured bandwidth, summed
    want = sum(r["decode_read_bytes"] / (MEASURED[n] * 1e9) * 1e3 for r, n in zip(before["plan"]["ranks"], names))
    assert after["plan"]["predicted_decode_ms"] == pytest.approx(want, rel=1e-3)
    assert "profile" not in before
    assert after["profile"]["path"] == str(profile_file)
    assert [m["matched_by"] for m in after["profile"]["gpus"]] == ["name", "name"]
    assert after["profile"]["line"].startswith(f"Decode speed: measured bandwidths from {profile_file} (calibrated 2026-05-01): ")


def test_plan_prints_the_profile_line(capsys, profile_file):
    assert main(["plan", "--gpus", GPUS, "--profile", str(profile_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"Decode speed: measured bandwidths from {profile_file} (calibrated 2026-05-01): "
                      "GPU 0 1,344 of 1,792 GB/s, GPU 1 420 of 672 GB/s")
    assert any(line.split()[:3] == ["bandwidth", "420", "GB/s"] for line in out)
    # the serve line tells the executor where the profile is (it is not the default one)
    assert f"VLLM_DUALGPU_MACHINE_PROFILE={profile_file} vllm serve" in "\n".join(out)


def test_default_profile_is_read_and_none_ignores_it(capsys, monkeypatch, tmp_path, profile_file):
    monkeypatch.setenv(MACHINE_PROFILE, "none")
    assert main(["plan", "--gpus", GPUS]) == 0
    today = capsys.readouterr().out
    assert "Decode speed:" not in today
    monkeypatch.delenv(MACHINE_PROFILE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "vllm-dualgpu").mkdir()
    profile_file.rename(tmp_path / "vllm-dualgpu" / "machine-profile.json")
    assert main(["plan", "--gpus", GPUS]) == 0
    measured = capsys.readouterr().out
    assert "Decode speed: measured bandwidths from" in measured and "VLLM_DUALGPU_MACHINE_PROFILE" not in measured
    assert main(["plan", "--gpus", GPUS, "--profile", "none"]) == 0
    ignored = capsys.readouterr().out
    assert ignored == today.replace("vllm serve", "VLLM_DUALGPU_MACHINE_PROFILE=none vllm serve")


def test_bw_given_beats_the_profile(capsys, profile_file):
    got = plan_json(capsys, "--gpus", "RTX 5090:bw=1000,RTX 4070 Ti SUPER", "--profile", str(profile_file))
    bws = {r["gpu"]["name"]: r["gpu"]["bandwidth_gbps"] for r in got["plan"]["ranks"]}
    assert bws == {"RTX 5090": 1000.0, "RTX 4070 Ti SUPER": 420.0}


def test_an_unreadable_profile_is_one_warning_then_todays_figures(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PROFILE, "schema": 7}))
    assert main(["plan", "--gpus", GPUS, "--profile", str(bad), *FIXED]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "calibrate" in warnings[0]
    assert "Decode speed:" not in captured.out
    assert any(line.split()[:3] == ["bandwidth", "672", "GB/s"] for line in captured.out.splitlines())
