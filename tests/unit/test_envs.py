"""Environment variables: sizes, reserves, partitions, each malformed value a clear error."""

import os

import pytest

from vllm_dualgpu import envs

GiB, MiB = 1024**3, 1024**2


@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("1.5GiB", int(1.5 * GiB)), ("512MiB", 512 * MiB), ("2", 2 * GiB),
    ("1GB", 10**9), (" 3 gib ", 3 * GiB), ("4096", 4096), ("1G", GiB),
])
def test_parse_size(text, expected):
    from vllm_dualgpu.planner import parse_size as planner_parse_size

    # One reader: the environment and the planner's --gpus read a size the same way.
    assert envs.parse_size(text) == expected == planner_parse_size(text)


@pytest.mark.parametrize("text", ["", "abc", "1.5XB", "1,5GiB", "--1GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="cannot read"):
        envs.parse_size(text, what="VLLM_DUALGPU_RESERVE")


@pytest.mark.parametrize("text", ["-1GiB", " -512MiB", "-0.5"])
def test_parse_size_says_a_negative_size_is_negative(text):
    with pytest.raises(ValueError, match=f"VLLM_DUALGPU_RESERVE: {text!r} is negative"):
        envs.parse_size(text, what="VLLM_DUALGPU_RESERVE")


def test_reserve_default_single_and_per_gpu():
    # unset: by each card's display (tests/unit/test_reserve_display.py); here NVML could not say
    assert [r.bytes for r in envs.reserves(None, [None, None])] == [GiB, GiB]
    assert [r.bytes for r in envs.reserves("1GiB", [None, None])] == [GiB, GiB]
    assert [r.bytes for r in envs.reserves("0,1.5GiB", [None, None])] == [0, int(1.5 * GiB)]


def test_reserve_count_mismatch_names_the_fix():
    with pytest.raises(ValueError, match="names 3 reserves for 2 visible GPUs"):
        envs.reserves("0,1GiB,2GiB", [None, None])


@pytest.mark.parametrize("text,msg", [
    ("12;28", "not a comma-separated list"),
    ("12,27", "summing to the model's 40 layers"),
    ("40,0", "positive layer counts"),
    ("10,10,20", "must give 2 positive"),
])
def test_partition_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        envs.parse_partition(text, 40, 2)


def test_partition_ok():
    assert envs.parse_partition("12,28", 40, 2) == [12, 28]
    assert envs.parse_partition(None, 40, 2) is None


@pytest.mark.parametrize("value,expected", [(None, "speed"), ("", "speed"), ("pool", "pool"), (" Pool ", "pool"),
                                            ("auto", "auto")])
def test_objective_unset_is_speed(monkeypatch, value, expected):
    """The executor and `plan` both ask the planner with this value (unset: the new default)."""
    from vllm_dualgpu.planner.objective import OBJECTIVE_ENV

    assert envs.OBJECTIVE == OBJECTIVE_ENV == "VLLM_DUALGPU_OBJECTIVE"
    if value is None:
        monkeypatch.delenv(envs.OBJECTIVE, raising=False)
    else:
        monkeypatch.setenv(envs.OBJECTIVE, value)
    assert envs.objective() == expected


def test_an_exported_variable_is_told_apart_from_the_users(monkeypatch):
    """The executor's export (the split, FlashInfer's workspace) is not taken back as the user's by
    a second plan in the same process; the user's own value is never overwritten nor removed."""
    name = "VLLM_DUALGPU_TEST_EXPORTED"
    monkeypatch.delenv(name, raising=False)
    var = envs.ExportedVariable(name)
    var.export("20,44")
    assert os.environ[name] == "20,44" and var.users_text() is None
    var.export("16,48")  # a second plan replaces its own export
    assert os.environ[name] == "16,48"
    var.export(None)  # and takes it back
    assert name not in os.environ and var.exported is None
    monkeypatch.setenv(name, "13,51")
    var.export("16,48")
    assert os.environ[name] == "13,51" and var.users_text() == "13,51"
    var.export(None)
    assert os.environ[name] == "13,51"
    monkeypatch.setenv(name, "  ")  # blank is no value of the user's
    assert var.users_text() is None
