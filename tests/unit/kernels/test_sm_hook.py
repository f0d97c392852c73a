"""The native sm hook on libraries laid out like vLLM's, built here with g++ (no CUDA needed).

``libfakecudart.so`` (sm_fakes.py) plays the CUDA runtime. ``libfakevllm_*.so`` define ``int get_sm_version_num()`` exactly as vLLM's
``_C_stable_libtorch`` does (device 0 hard-coded, default visibility, mangled
``_Z18get_sm_version_numv``) and call it from ``fake_dispatch()`` in the same library, so the
call goes through the PLT. The production install path then binds the fake runtime through the
library's own dependencies, as it binds libcudart in a vLLM worker.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import sys

import pytest
from sm_fakes import build, fake_cudart, load, on_device

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import sm_hook
from vllm_dualgpu.kernels.sm_hook import SYMBOL, SmHookError, install_sm_hook, select_library, sm_hook_status

try:
    from vllm_dualgpu import _C
except ImportError:
    _C = None
try:
    import capstone  # noqa: F401  (the coverage analysis)

    HAVE_CAPSTONE = True
except ImportError:
    HAVE_CAPSTONE = False

# Marks, not a module-level importorskip: a run that deselects these tests (``pytest -m gpu``)
# does not report them as skipped.
pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the fake libraries"),
    pytest.mark.skipif(_C is None, reason="extension not built (python setup.py build_ext --inplace)"),
]

JUMP_SLOT = {"x86_64": "R_X86_64_JUMP_SLOT", "aarch64": "R_AARCH64_JUMP_SLOT"}.get(platform.machine(), "?")

# The body of vLLM 0.30's get_sm_version_num, as its disassembly shows (docs/sm-hook.md).
VLLM = r"""
extern "C" int cudaDeviceGetAttribute(int* value, int attr, int device);
int get_sm_version_num() {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, 75, 0);
    cudaDeviceGetAttribute(&minor, 76, 0);
    return major * 10 + minor;
}
extern "C" int fake_dispatch() { return get_sm_version_num(); }
extern "C" int cudaGetDevice(int* device);
extern "C" int fake_current() { int d = -1; cudaGetDevice(&d); return d; }
"""

VARIANTS = {
    "plain": ["-Wl,-z,lazy"],  # never hooked: shows stock behaviour
    "lazy": ["-Wl,-z,lazy"],
    "now": ["-Wl,-z,now", "-Wl,-z,relro"],
    "probe": ["-Wl,-z,lazy"],
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakelibs")
    cudart_path, cudart = fake_cudart()
    out = {"dir": d, "cudart_path": cudart_path, "cudart": cudart}
    for name, flags in VARIANTS.items():
        so = build(d, f"libfakevllm_{name}.so", VLLM, flags, cudart_path)
        out[name] = load(so)
        out[f"{name}_path"] = str(so)
    return out


def run_on(lib, cudart, device: int) -> int:
    """fake_dispatch() called from a fresh thread whose current (fake) device is `device`."""
    return on_device(lib.fake_dispatch, cudart, device)


def slot_page_writable(slot: int) -> bool:
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= slot < end:
            return perms[1] == "w"
    raise AssertionError("slot not mapped")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_fake_calls_through_a_jump_slot_like_vllm(libs, variant):
    relocs = subprocess.run(["readelf", "-rW", libs[f"{variant}_path"]], capture_output=True, text=True).stdout
    lines = [ln for ln in relocs.splitlines() if SYMBOL in ln]
    assert lines and all(JUMP_SLOT in ln for ln in lines), relocs


def test_without_the_hook_every_thread_gets_device_zero(libs):
    # The bug being fixed: device 1 (12.0) and device 2 (9.0) both hear 89.
    assert [run_on(libs["plain"], libs["cudart"], d) for d in (0, 1, 2)] == [89, 89, 89]


def test_hook_answers_for_each_threads_current_device(libs):
    rank_summary.clear()
    report = install_sm_hook(library="libfakevllm_lazy")
    assert report.library == libs["lazy_path"]
    assert report.symbol == SYMBOL
    assert report.rewritten == 1 and report.already == 0 and len(report.slots) == 1
    assert report.binding == "lazy" and report.read_only is False
    assert report.new_target == _C.sm_version_hook_address()
    assert report.cuda_runtime == str(libs["cudart_path"])
    defined = ctypes.cast(getattr(libs["lazy"], SYMBOL), ctypes.c_void_p).value
    assert report.definition == defined
    assert report.old_targets == (defined,)  # ctypes, like Python's importer, binds at load time
    assert [run_on(libs["lazy"], libs["cudart"], d) for d in (0, 1, 2, 1, 0)] == [89, 120, 90, 120, 89]
    # The worker's summary line names the library, the symbol and the slot change.
    fact = rank_summary.facts()["sm-hook"]
    assert "libfakevllm_lazy.so" in fact and SYMBOL in fact and "1 PLT slot rewritten" in fact
    if HAVE_CAPSTONE:  # one query in the fake (fake_dispatch's call through the PLT), covered
        assert report.coverage.total == 1 and report.coverage.covered == 1
        assert fact.startswith("libfakevllm_lazy.so: 1 of 1 capability queries covered")
    else:  # installed all the same, and the note says the coverage is unknown, and why
        assert report.coverage is None and "capstone" in report.coverage_error
        assert fact.startswith("libfakevllm_lazy.so: coverage not analysed (")
    assert hex(report.new_target) in fact and "libfakecudart.so" in fact
    # ... and what the hook answers on the installing thread's device (the worker's own GPU).
    assert report.answer in (89, 120, 90) and report.answer == _C.sm_version_current_device()
    assert f"answers {report.answer} here" in fact


def test_second_install_is_a_no_op(libs):
    first = install_sm_hook(library="libfakevllm_lazy")
    again = install_sm_hook(library="libfakevllm_lazy")
    assert again.rewritten == 0 and again.already == 1
    assert again.slots == first.slots and again.old_targets == (first.new_target,)
    assert run_on(libs["lazy"], libs["cudart"], 1) == 120


def test_other_slots_of_the_library_are_left_alone(libs):
    # Only get_sm_version_num's and cudaDeviceGetAttribute's slots are rewritten: the fake's
    # import of cudaGetDevice keeps its target.
    before = _C.plt_slots(libs["lazy_path"], "cudaGetDevice")
    install_sm_hook(library="libfakevllm_lazy")
    after = _C.plt_slots(libs["lazy_path"], "cudaGetDevice")
    assert before["slots"] and after["targets"] == before["targets"]


def test_read_only_got_full_relro(libs):
    status = sm_hook_status(library="libfakevllm_now")
    (slot,) = status["slots"]
    assert status["binding"] == "now" and not status["hooked"]
    assert not slot_page_writable(slot)  # -z now -z relro: the loader sealed the GOT
    report = install_sm_hook(library="libfakevllm_now")
    assert report.read_only is True and report.rewritten == 1
    assert [run_on(libs["now"], libs["cudart"], d) for d in (1, 2)] == [120, 90]
    assert not slot_page_writable(slot)  # sealed again after the store
    assert sm_hook_status(library="libfakevllm_now")["hooked"]


def test_target_address_is_a_parameter(libs):
    probe = ctypes.cast(libs["cudart"].fake_probe, ctypes.c_void_p).value
    report = install_sm_hook(library="libfakevllm_probe", target=probe)
    assert report.new_target == probe and report.cuda_runtime is None
    assert run_on(libs["probe"], libs["cudart"], 1) == 4242
    assert not sm_hook_status(library="libfakevllm_probe")["hooked"]  # not the per-device one


def test_missing_library_is_refused_loudly():
    with pytest.raises(SmHookError, match=r"no library named libnotloaded_xyz\* is loaded"):
        install_sm_hook(library="libnotloaded_xyz")
    status = sm_hook_status(library="libnotloaded_xyz")
    assert status["extension"] and status["library"] is None and "libnotloaded_xyz" in status["error"]


def test_missing_symbol_is_refused_loudly(libs):
    with pytest.raises(SmHookError, match=rf"no {JUMP_SLOT} relocation for _Z8no_suchv"):
        install_sm_hook(library="libfakevllm_lazy", symbol="_Z8no_suchv", target=1)
    # A library that makes no capability query (the fake runtime) is refused before anything
    # is written.
    refusal = ": NOT covered: no device-0 capability query" if HAVE_CAPSTONE else f" has no {JUMP_SLOT} relocation"
    with pytest.raises(SmHookError, match=f"libfakecudart.so{refusal}"):
        install_sm_hook(library="libfakecudart")


def test_missing_extension_is_refused_loudly(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_dualgpu._C", None)  # makes the import fail
    with pytest.raises(SmHookError, match="vllm_dualgpu._C is not importable"):
        install_sm_hook()
    assert sm_hook_status()["extension"] is False


def test_only_vllms_main_library_matches():
    loaded = [
        "/env/lib/libtorch_cuda.so",
        "/env/vllm/_moe_C_stable_libtorch.abi3.so",
        "/env/vllm/_C_stable_libtorch.abi3.so",
    ]
    assert select_library(loaded) == "/env/vllm/_C_stable_libtorch.abi3.so"
    with pytest.raises(SmHookError, match="2 loaded libraries match"):
        select_library(loaded + ["/other/_C_stable_libtorch.abi3.so"])
    with pytest.raises(SmHookError, match=r"no library named _C_stable_libtorch\*"):
        select_library(loaded[:2])


def test_native_hook_refuses_to_run_unbound_in_a_fresh_process(tmp_path):
    # Without a bound runtime the diagnostic call raises instead of jumping through a null pointer.
    code = (
        "from vllm_dualgpu import _C\n"
        "try:\n    _C.sm_version_current_device()\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert "refused: the CUDA runtime is not bound yet" in out.stdout, out.stderr


def test_status_when_vllms_library_is_not_loaded_says_so():
    if any("_C_stable_libtorch" in p for p in _C.loaded_libraries()):
        pytest.skip("vLLM's CUDA library is loaded in this process")
    status = sm_hook.sm_hook_status()
    assert status["extension"] is True and status["hooked"] is False
    assert "no library named _C_stable_libtorch* is loaded" in status["error"]
