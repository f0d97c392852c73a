"""`vllm-dualgpu doctor` and the dry-run patch check it is built on."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_dualgpu._version import SUPPORTED_VLLM

from vllm_dualgpu.cli import doctor, main
from vllm_dualgpu.nvml import VisibleGpu
from vllm_dualgpu.patching.core import ALREADY, APPLIED, READY, SKIPPED, Patch, apply_patch, check_patch, revert_patch

GiB = 1024**3

BIG = VisibleGpu(physical_id=0, name="NVIDIA GeForce RTX 5090", total_bytes=32 * GiB,
                 free_bytes=30 * GiB, capability=(12, 0), bandwidth_gbps=1792.0, uuid="GPU-a")
SMALL = VisibleGpu(physical_id=1, name="NVIDIA GeForce RTX 4070 Ti SUPER", total_bytes=16 * GiB,
                   free_bytes=15 * GiB, capability=(8, 9), bandwidth_gbps=672.0, uuid="GPU-b")


@pytest.fixture(autouse=True)
def restore_logging_env(monkeypatch):
    # run() quiets vLLM's logging through the environment (setdefault); this value is undone
    # after each test, so later tests (and their subprocesses) log as before.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")


def no_nvml():
    import pynvml

    raise pynvml.NVMLError_LibraryNotFound()


@pytest.fixture
def fake_target(monkeypatch):
    target = types.ModuleType("doc_target")
    exec("def f(x, y):\n    return x + y\n", target.__dict__)
    holder = types.ModuleType("doc_holder")
    holder.f = target.f
    factories = types.ModuleType("doc_factories")
    factories.double = lambda original: (lambda x, y: 2 * original(x, y))
    for m in (target, holder, factories):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return target, holder


def make(**kw) -> Patch:
    base = dict(name="t", target="doc_target:f", processes=("worker",), vllm_versions=SUPPORTED_VLLM,
                why="w", upstream="u", remove_when="r", factory="doc_factories:double",
                params=("x", "y"), copies=("doc_holder",))
    return Patch(**{**base, **kw})


def test_check_patch_is_a_dry_run(fake_target):
    target, holder = fake_target
    original = target.f
    out = check_patch(make(), "0.30.0")
    assert out.status == READY and out.rebound == ["doc_holder"]
    assert target.f is original and holder.f is original  # nothing changed
    assert apply_patch(make(), "0.30.0").status == APPLIED
    assert check_patch(make(), "0.30.0").status == ALREADY
    assert revert_patch(make())


@pytest.mark.parametrize(
    "kw",
    [
        dict(params=("x",)),                           # signature changed
        dict(target="doc_target:gone"),                # target removed
        dict(vllm_versions=">=0.34"),                  # other vLLM
        dict(factory="doc_factories:missing"),         # factory gone
    ],
)
def test_check_and_apply_refuse_for_the_same_reason(fake_target, kw):
    target, _ = fake_target
    original = target.f
    checked, applied = check_patch(make(**kw), "0.30.0"), apply_patch(make(**kw), "0.30.0")
    assert checked.status == applied.status == SKIPPED
    assert checked.reason == applied.reason and checked.reason
    assert target.f is original


def test_foreign_copy_is_reported_by_the_dry_run(fake_target):
    _, holder = fake_target
    holder.f = lambda x, y: 0
    out = check_patch(make(), "0.30.0")
    assert out.status == SKIPPED and "doc_holder.f is not vLLM's original" in out.reason


def test_bandwidth_classes():
    assert doctor.bandwidth_class(4800.0).endswith("very high (HBM)")
    assert doctor.bandwidth_class(1792.0).endswith(", high")
    assert doctor.bandwidth_class(672.0).endswith(", medium")
    assert doctor.bandwidth_class(288.0).endswith(", low")
    assert doctor.bandwidth_class(None) == "bandwidth unknown"


def test_gpu_lines_show_each_card():
    lines, gpus = doctor.gpu_lines(read=lambda: [BIG, SMALL])
    assert gpus == [BIG, SMALL]
    text = "\n".join(lines)
    assert "0: NVIDIA GeForce RTX 5090 (GPU 0), sm_120 (12.0), 32.0 GiB total, 30.0 GiB free, 1,792 GB/s, high" in text
    assert "1: NVIDIA GeForce RTX 4070 Ti SUPER (GPU 1), sm_89 (8.9)" in text and "672 GB/s, medium" in text


def test_without_nvml_it_says_so():
    lines, gpus = doctor.gpu_lines(read=no_nvml)
    assert gpus == [] and lines[0].startswith("GPUs: none visible (NVMLError_LibraryNotFound")


def test_configs_are_matched_to_each_card_by_vllms_file_name(tmp_path):
    small = "NVIDIA_GeForce_RTX_4070_Ti_SUPER"
    for n in (5120, 14336):
        (tmp_path / f"N={n},K=5120,device_name={small},dtype=fp8_w8a8,block_shape=[128,128].json").write_text("{}")
    (tmp_path / "E=8,N=1024,device_name=NVIDIA_H200.json").write_text("{}")
    # a longer name that merely starts with the card's name is another card
    (tmp_path / f"N=1,K=1,device_name={small}_X,dtype=fp8_w8a8,block_shape=[128,128].json").write_text("{}")
    (tmp_path / "README.md").write_text("")
    text = "\n".join(doctor.config_lines([BIG, SMALL], tmp_path))
    assert "NVIDIA GeForce RTX 4070 Ti SUPER: 2 files" in text
    assert "NVIDIA GeForce RTX 5090: 0 files (none named NVIDIA_GeForce_RTX_5090)" in text
    assert "also for: NVIDIA_GeForce_RTX_4070_Ti_SUPER_X (1), NVIDIA_H200 (1)" in text


def _targets_now(patches) -> dict:
    from vllm_dualgpu.patching.core import _function_of, _raw_attr, _resolve_owner

    now = {}
    for p in patches:
        try:
            now[p.name] = _function_of(_raw_attr(*_resolve_owner(p)))
        except (ImportError, AttributeError):
            now[p.name] = None  # vllm.platforms.cuda without a driver, or not in this release
    return now


def test_patch_lines_cover_the_registry_without_changing_vllm():
    from vllm_dualgpu.patching.registry import PATCHES

    before = _targets_now(PATCHES)
    import vllm

    from vllm_dualgpu.patching.core import version_in_range

    lines, outcomes = doctor.patch_lines(vllm.__version__)
    assert _targets_now(PATCHES) == before  # a dry run: every target is the same object
    here = [p for p in PATCHES if version_in_range(vllm.__version__, p.vllm_versions)]
    assert [p for p, _ in outcomes] == here  # every entry for this release, one line each
    for p in here:
        (line,) = [ln for ln in lines if f" {p.name} " in ln]
        assert line.split()[0] in ("applies", "applied", "skipped", "failed")
    others = len(PATCHES) - len(here)
    assert not others or f"({others} more for other vLLM releases" in "\n".join(lines)
    assert any(ln.split()[0] in ("applies", "applied") and " executor-by-name " in ln for ln in lines)


def test_doctor_without_gpus_prints_a_short_report(monkeypatch, capsys):
    import vllm_dualgpu.nvml

    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", no_nvml)
    assert main(["doctor"]) == 1  # the dualgpu path cannot work without GPUs (issue 17)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "GPUs: none visible" in out
    assert "Native extension: vllm_dualgpu._C" in out and "importable" in out
    assert "config-file-name-per-rank" in out and "Tuned kernel configs" in out
    from vllm_dualgpu.patching.core import version_in_range
    from vllm_dualgpu.patching.registry import PATCHES

    # One line per patch of this release; everything else stays under 20 lines.
    import vllm

    here = sum(version_in_range(vllm.__version__, p.vllm_versions) for p in PATCHES)
    assert len(out.splitlines()) < 20 + here


def test_doctor_fails_when_the_extension_is_missing(monkeypatch, capsys):
    import vllm_dualgpu.nvml

    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", no_nvml)
    # Without GPUs doctor exits 1 anyway: the Result line must name the extension as a reason,
    # and only when it is missing.
    main(["doctor"])
    result = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Result:")]
    assert len(result) == 1 and "extension" not in result[0]
    monkeypatch.setitem(sys.modules, "vllm_dualgpu._C", None)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "Native extension: NOT importable" in out
    result = [line for line in out.splitlines() if line.startswith("Result:")]
    assert len(result) == 1 and result[0].startswith("Result: the dualgpu path cannot work here (")
    assert "extension" in result[0].split("(", 1)[1]


def test_doctor_fails_when_a_required_patch_cannot_apply_on_a_gpu_machine(monkeypatch, capsys):
    import vllm_dualgpu.nvml
    from vllm_dualgpu.patching import registry

    monkeypatch.setattr(vllm_dualgpu.nvml, "read_visible_gpus", lambda: [BIG, SMALL])
    broken = make(name="broken", target="vllm.utils.platform_utils:get_device_name_as_file_name",
                  params=("nope",), copies=())
    monkeypatch.setattr(registry, "PATCHES", (broken,))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "skipped  broken" in out and "expected (nope)" in out
    assert "NVIDIA GeForce RTX 5090: 0 files" in out
