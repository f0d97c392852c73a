"""Every registry entry has its own test module: tests/{unit,integration}/patches/test_patch_<name>.py
(the entry's name with '-' as '_'), and no such module names an entry that does not exist."""

from __future__ import annotations

from pathlib import Path

from vllm_dualgpu.patching.registry import PATCHES

TESTS = Path(__file__).resolve().parents[2]
FOLDERS = (TESTS / "unit" / "patches", TESTS / "integration" / "patches")


def module_name(entry: str) -> str:
    return "test_patch_" + entry.replace("-", "_") + ".py"


def test_every_entry_has_a_test_module():
    present = {f.name for d in FOLDERS for f in d.glob("test_patch_*.py")}
    missing = [p.name for p in PATCHES if module_name(p.name) not in present]
    assert not missing, (f"registry entries without a test module: {missing}; add "
                         f"tests/unit/patches/ or tests/integration/patches/{module_name(missing[0])}")


def test_no_module_for_an_entry_that_is_gone():
    expected = {module_name(p.name) for p in PATCHES}
    stray = sorted(f"{d.name}/{f.name}" for d in FOLDERS for f in d.glob("test_patch_*.py")
                   if f.name not in expected)
    assert not stray, f"test modules named for no registry entry: {stray}"


def test_each_entry_tested_in_one_place():
    for p in PATCHES:
        where = [d for d in FOLDERS if (d / module_name(p.name)).exists()]
        assert len(where) <= 1, f"{p.name}: test modules in both {where}"
