"""The memory kept free on a card follows whether it drives a display.

A card with an active display (a desktop has memory on it), or one NVML cannot say about, keeps
1 GiB free; a card without one keeps 256 MiB; ``VLLM_DUALGPU_RESERVE`` overrides both. NVML is
the package's test stand-in (tests/fixtures/fake_nvml), loaded in place of pynvml.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vllm_dualgpu import envs
from vllm_dualgpu.nvml import VisibleGpu, read_visible_gpus, to_gpu_facts
from vllm_dualgpu.planner.errors import BadRequest
from vllm_dualgpu.planner.gpus import parse_gpus

GiB, MiB = 1024**3, 1024**2
FAKE_NVML = Path(__file__).parents[1] / "fixtures" / "fake_nvml" / "pynvml.py"
CARD = {"total_bytes": 16 * GiB, "free_bytes": 15 * GiB, "capability": [8, 9]}


@pytest.fixture
def nvml(monkeypatch):
    """Load the NVML stand-in as ``pynvml`` with the given cards (``display``: True, False,
    or absent: NVML answers 'not supported')."""

    def cards(*gpus):
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.setenv("FAKE_NVML_GPUS", json.dumps([{"name": f"NVIDIA GPU {i}", **CARD, **g}
                                                         for i, g in enumerate(gpus)]))
        spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    return cards


def test_nvml_reads_each_cards_display(nvml):
    nvml({"display": True}, {"display": False}, {})
    assert [g.display for g in read_visible_gpus()] == [True, False, None]


def test_a_display_query_that_fails_otherwise_is_unknown(nvml):
    fake = nvml({"display": True}, {"display": False})

    def broken(handle):
        raise RuntimeError("driver gone")

    fake.nvmlDeviceGetDisplayActive = broken
    assert [g.display for g in read_visible_gpus()] == [None, None]


def test_display_active_inactive_unknown_keep_1gib_256mib_1gib(nvml, monkeypatch):
    monkeypatch.delenv(envs.RESERVE, raising=False)
    nvml({"display": True}, {"display": False}, {})
    got = envs.reserves(None, [g.display for g in read_visible_gpus()])
    assert [r.bytes for r in got] == [GiB, 256 * MiB, GiB]
    assert [r.why for r in got] == ["display active", "no display on this card", "display state unknown"]


def test_the_headless_reserve_is_a_named_constant_next_to_the_default():
    assert envs.DEFAULT_RESERVE_BYTES == GiB
    assert envs.HEADLESS_RESERVE_BYTES == 256 * MiB


@pytest.mark.parametrize("text,expected", [("2GiB", [2 * GiB] * 3), ("0,512MiB,1.5GiB", [0, 512 * MiB, int(1.5 * GiB)])])
def test_vllm_dualgpu_reserve_overrides_the_display_rule(text, expected):
    got = envs.reserves(text, [True, False, None])
    assert [r.bytes for r in got] == expected
    assert {r.why for r in got} == {"VLLM_DUALGPU_RESERVE"}


def test_a_reserve_list_of_the_wrong_length_still_names_the_fix():
    with pytest.raises(ValueError, match="names 3 reserves for 2 visible GPUs"):
        envs.reserves("0,1GiB,2GiB", [True, False])


def test_the_planners_facts_carry_the_display():
    seen = [VisibleGpu(0, "NVIDIA GeForce RTX 5090", 32 * GiB, 30 * GiB, (12, 0), None, "GPU-a", display=True),
            VisibleGpu(1, "NVIDIA GeForce RTX 4070 Ti SUPER", 16 * GiB, 16 * GiB, (8, 9), None, "GPU-b",
                       display=False)]
    assert [g.display for g in to_gpu_facts(seen)] == [True, False]


@pytest.mark.parametrize("entry,expected", [
    ("RTX 5090:display=yes", True), ("RTX 5090:32GiB:display=no", False), ("RTX 5090:display=YES", True),
    ("RTX 5090", None),
])
def test_gpus_display_key(entry, expected):
    (card,) = parse_gpus(entry)
    assert card.display is expected


def test_gpus_display_key_refuses_other_values_in_one_line():
    with pytest.raises(BadRequest) as e:
        parse_gpus("RTX 5090:display=maybe")
    msg = str(e.value)
    assert "display=" in msg and "'maybe'" in msg and "display=yes" in msg and "display=no" in msg
    assert "\n" not in msg


def test_an_unknown_key_lists_display_among_the_keys():
    with pytest.raises(BadRequest, match="display="):
        parse_gpus("RTX 5090:screen=yes")


# --- virtual cards: the spec's key, else headless (the physical data-centre GPU has no display) ---

H200 = VisibleGpu(3, "NVIDIA H200", 143771 * MiB, 139 * GiB, (9, 0), 4800.0, "GPU-h200")


def test_virtual_cards_are_headless_unless_the_spec_says_display_yes():
    from vllm_dualgpu.virtual_gpus import substitute

    gpus, cards = substitute([H200], "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:display=yes,H200:24GiB:display=no")
    assert [c.display for c in cards] == [False, True, False]
    assert [g.display for g in gpus] == [False, True, False]  # what the executor's reserves read
    assert [r.bytes for r in envs.reserves(None, [g.display for g in gpus])] == [256 * MiB, GiB, 256 * MiB]


def test_a_virtual_specs_bad_display_value_names_the_variable_and_the_key():
    from vllm_dualgpu.virtual_gpus import ENV, parse

    with pytest.raises(BadRequest) as e:
        parse("RTX 4070 Ti SUPER:16GiB:display=on,RTX 5090:32GiB", 3, H200.name, H200.total_bytes,
              H200.free_bytes, (9, 0))
    assert ENV in str(e.value) and "display=" in str(e.value)


def test_the_virtual_cards_display_travels_in_the_hand_off():
    from vllm_dualgpu.engine import handoff
    from vllm_dualgpu.virtual_gpus import substitute

    _, cards = substitute([H200], "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:display=yes")
    ranks = tuple(handoff.RankRecord(rank=i, physical_gpu_id=3, gpu_name=c.name, reserve_bytes=GiB,
                                     cap_bytes=None, num_layers=20, predicted_non_kv_bytes=GiB,
                                     virtual_card=c, reserve_reason="display active") for i, c in enumerate(cards))
    back = handoff.Handoff.from_dict(handoff.Handoff(ranks, (20, 20), "plan").to_dict())
    assert [r.virtual_card.display for r in back.ranks] == [False, True]
    assert back.rank(1).reserve_reason == "display active"


# --- `plan`'s side: the reserve a card without reserve= gets ---

@pytest.mark.parametrize("spec,env,expected", [
    ("RTX 5090:display=yes,RTX 4070 Ti SUPER:display=no", None, [GiB, 256 * MiB]),
    ("RTX 5090,RTX 4070 Ti SUPER", None, [GiB, GiB]),  # offline, not said: as today
    ("RTX 5090:display=yes,RTX 4070 Ti SUPER:display=no:reserve=0", None, [GiB, 0]),  # reserve= wins
    ("RTX 5090:display=yes,RTX 4070 Ti SUPER:display=no", "512MiB", [512 * MiB, 512 * MiB]),
])
def test_plan_keeps_free_what_the_executor_would(monkeypatch, spec, env, expected):
    from vllm_dualgpu.cli.inputs import with_default_reserves

    if env is None:
        monkeypatch.delenv(envs.RESERVE, raising=False)
    else:
        monkeypatch.setenv(envs.RESERVE, env)
    assert [g.reserve_bytes for g in with_default_reserves(parse_gpus(spec), spec)] == expected


def test_plans_note_says_why_each_card_keeps_what_it_keeps(monkeypatch, capsys):
    from vllm_dualgpu.cli import main

    monkeypatch.delenv(envs.RESERVE, raising=False)
    argv = ["plan", "--gpus", "RTX 5090:display=yes,RTX 4070 Ti SUPER:display=no:reserve=2GiB,RTX 4080",
            "-pp", "3", "--max-model-len", "8192"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if line.startswith("Note: left free for others")]
    assert "1.00 GiB on [0] RTX 5090 (display active)" in note
    assert "2.00 GiB on [1] RTX 4070 Ti SUPER (--gpus reserve=)" in note
    assert "1.00 GiB on [2] RTX 4080 (display state unknown" in note
    assert "display=no" in note  # how to say a card is headless


@pytest.mark.parametrize("entries,env,expected", [
    (("display=yes", "display=no"), "512MiB", {0: (512 * MiB, envs.RESERVE), 1: (512 * MiB, envs.RESERVE)}),
    (("display=yes", "display=no"), "512MiB,2GiB", {0: (512 * MiB, envs.RESERVE), 1: (2 * GiB, envs.RESERVE)}),
    (("display=yes", "display=no:reserve=0"), "2GiB", {0: (2 * GiB, envs.RESERVE), 1: (0, "--gpus reserve=")}),
])
def test_plan_gpus_with_display_keys_under_the_environment(monkeypatch, capsys, entries, env, expected):
    """`plan --gpus` with display= keys and VLLM_DUALGPU_RESERVE set: the environment's sizes
    over the display rule, a card's reserve= over both; the plan and its note agree."""
    from vllm_dualgpu.cli import main

    monkeypatch.setenv(envs.RESERVE, env)
    spec = f"RTX 5090:{entries[0]},RTX 4070 Ti SUPER:{entries[1]}"
    assert main(["plan", "--gpus", spec, "-pp", "2", "--max-model-len", "8192", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {r["gpu"]["index"]: r["gpu"]["reserve_bytes"] for r in printed["plan"]["ranks"]} == {
        i: size for i, (size, _) in expected.items()}
    (note,) = [n for n in printed["notes"] if n.startswith("left free for others")]
    for i, (size, why) in expected.items():
        assert f"{size / GiB:.2f} GiB on [{i}] " in note and why in note.split(f"on [{i}] ")[1].split(")")[0]


def test_doctor_gives_plan_the_reserve_of_each_cards_display(monkeypatch):
    import vllm_dualgpu.nvml
    from vllm_dualgpu.cli import doctor

    monkeypatch.delenv(envs.RESERVE, raising=False)
    seen = [VisibleGpu(0, "NVIDIA GeForce RTX 5090", 32 * GiB, 30 * GiB, (12, 0), 1792.0, "GPU-a", display=True),
            VisibleGpu(1, "NVIDIA GeForce RTX 4070 Ti SUPER", 16 * GiB, 16 * GiB, (8, 9), 672.0, "GPU-b",
                       display=False),
            VisibleGpu(2, "NVIDIA GeForce RTX 4080", 16 * GiB, 16 * GiB, (8, 9), 717.0, "GPU-c")]
    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", lambda: seen)
    lines, _ = doctor.gpu_lines()
    (line,) = [x for x in lines if "as plan --gpus local sees them" in x]
    parsed = parse_gpus(line.split("--gpus ", 2)[2].strip("'"))
    assert [g.reserve_bytes for g in parsed] == [GiB, 256 * MiB, GiB]
    assert [g.display for g in parsed] == [True, False, None]
