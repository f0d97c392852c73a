"""The machine profile (vllm_dualgpu/machine_profile.py): written and read back, applied to the
planner's cards by UUID first, then by name; a card it does not name keeps its figure; a file
that cannot be used is one warning and today's figures."""

from __future__ import annotations

import json

import pytest

from vllm_dualgpu import machine_profile as mp
from vllm_dualgpu.envs import MACHINE_PROFILE
from vllm_dualgpu.planner import parse_gpus

PROFILE = {
    "schema": 1, "created": "2026-05-01T10:00:00+00:00", "torch": "2.9.0", "vllm": "0.33.0",
    "gpus": [
        {"uuid": "GPU-aaaa", "name": "NVIDIA GeForce RTX 5090", "pci_bus_id": "00000000:01:00.0",
         "total_bytes": 34190917632, "datasheet_gbps": 1792, "read_gbps": 1500.0, "copy_gbps": 1400.0},
        {"uuid": "GPU-bbbb", "name": "NVIDIA GeForce RTX 4070 Ti SUPER", "pci_bus_id": "00000000:02:00.0",
         "total_bytes": 17171480576, "datasheet_gbps": 672, "read_gbps": 600.0, "copy_gbps": 550.0},
    ],
}


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


def test_round_trip(tmp_path):
    profile = mp.MachineProfile.from_dict(PROFILE)
    path = mp.write(profile, tmp_path / "sub" / "p.json")
    back = mp.read(path)
    assert back == profile
    assert json.loads(path.read_text()) == PROFILE
    assert back.gpus[1].read_gbps == 600.0 and back.gpus[0].uuid == "GPU-aaaa"


def test_default_path_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv(MACHINE_PROFILE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mp.default_path() == tmp_path / "xdg" / "vllm-dualgpu" / "machine-profile.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mp.default_path() == tmp_path / "home" / ".cache" / "vllm-dualgpu" / "machine-profile.json"
    monkeypatch.setenv(MACHINE_PROFILE, str(tmp_path / "elsewhere.json"))
    assert mp.default_path() == tmp_path / "elsewhere.json"
    monkeypatch.setenv(MACHINE_PROFILE, "none")
    assert mp.default_path() is None


def test_uuid_first_then_name(profile_file):
    # By UUID: the card called "RTX 5090" whose UUID is the 4070's gets the 4070's figure.
    gpus = parse_gpus("RTX 5090,RTX 4070 Ti SUPER")
    got = mp.apply(gpus, ["GPU-bbbb", None], path=profile_file)
    assert [g.bandwidth_gbps for g in got.gpus] == [600.0, 600.0]
    assert [m["matched_by"] for m in got.matches] == ["uuid", "name"]
    # By name ("RTX 5090" is NVML's "NVIDIA GeForce RTX 5090"), without UUIDs.
    got = mp.apply(gpus, None, path=profile_file)
    assert [g.bandwidth_gbps for g in got.gpus] == [1500.0, 600.0]
    assert got.line == (f"Decode speed: measured bandwidths from {profile_file} (calibrated 2026-05-01): "
                        "GPU 0 1,500 of 1,792 GB/s, GPU 1 600 of 672 GB/s")
    assert got.warning is None


def test_a_known_uuid_not_in_the_profile_is_not_matched_by_name(profile_file):
    # Another physical card of the same model (or a virtual card on one): its own figure.
    gpus = parse_gpus("RTX 5090")
    got = mp.apply(gpus, ["GPU-other"], path=profile_file)
    assert got.gpus[0].bandwidth_gbps == 1792
    assert "GPU 0 1,792 GB/s (not in the profile)" in got.line


def test_unmatched_keeps_its_figure_and_bw_given_is_kept(profile_file):
    gpus = parse_gpus("RTX 3090,RTX 5090:bw=1000,RTX 5090 D:32GiB")
    got = mp.apply(gpus, None, path=profile_file, keep={1})
    # "RTX 5090 D" is not "RTX 5090": it keeps the table's figure for it, not the measured 1,500
    assert [g.bandwidth_gbps for g in got.gpus] == [936, 1000.0, 1792]
    assert [m["matched_by"] for m in got.matches] == [None, None, None]
    assert "GPU 1 1,000 GB/s as given (bw=)" in got.line


def test_same_name_cards_take_the_profiles_cards_of_that_name_in_order(tmp_path):
    data = json.loads(json.dumps(PROFILE))
    data["gpus"][1].update(name="NVIDIA GeForce RTX 5090", read_gbps=1600.0)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    got = mp.apply(parse_gpus("RTX 5090,RTX 5090,RTX 5090"), None, path=path)
    assert [g.bandwidth_gbps for g in got.gpus] == [1500.0, 1600.0, 1600.0]


@pytest.mark.parametrize("text,why", [
    ("{not json", "Expecting"),
    (json.dumps({**PROFILE, "schema": 99}), "schema 99"),
    (json.dumps({"schema": 1, "created": "x"}), "missing or malformed"),
])
def test_bad_file_warns_and_falls_back(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    gpus = parse_gpus("RTX 5090,RTX 4070 Ti SUPER")
    got = mp.apply(gpus, None, path=path)
    assert got.gpus == gpus and got.line is None
    assert str(path) in got.warning and why in got.warning
    assert "vllm-dualgpu calibrate" in got.warning


def test_no_default_file_and_none_mean_no_profile(monkeypatch, tmp_path, profile_file):
    gpus = parse_gpus("RTX 5090")
    monkeypatch.setenv(MACHINE_PROFILE, str(tmp_path / "absent.json"))
    got = mp.apply(gpus)
    assert got.gpus == gpus and got.line is None and got.warning is None
    monkeypatch.setenv(MACHINE_PROFILE, str(profile_file))
    assert mp.apply(gpus).gpus[0].bandwidth_gbps == 1500.0
    assert mp.apply(gpus, path="none").gpus == gpus
    # a path asked for by name that is not there: a warning, not silence
    assert "absent.json" in mp.apply(gpus, path=tmp_path / "absent.json").warning
