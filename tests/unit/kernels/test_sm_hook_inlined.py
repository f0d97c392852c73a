"""The sm hook and its coverage analysis on libraries laid out like vLLM 0.30 and 0.32+, built here.

``libfake033_*.so`` is laid out like vLLM 0.32/0.33's ``_C_stable_libtorch``: ``get_sm_version_num``
is still defined (default visibility) but the dispatchers inline its body, so they call
``cudaDeviceGetAttribute(&v, 75/76, 0)`` themselves through the library's import slot. The
source below has, by construction:

- 3 inlined device-0 queries (major + minor each): ``fake_dispatch_a`` (1), ``fake_dispatch_b`` (2);
- 1 call of ``get_sm_version_num`` through the PLT (``fake_error_path``, like 0.33's ``.cold``
  paths);
- 1 capability query of a computed device (``fake_query_device``) and 1 device-0 query of
  another attribute (``fake_sm_count``): neither is a hard-coded device-0 capability query.

So the hook covers 4 of 4 queries, and the 0.30-style hook alone (get_sm_version_num's slot) 1 of 4.
``libfake030.so`` is laid out like 0.30: 2 calls of ``get_sm_version_num`` through the PLT.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from sm_fakes import build, fake_cudart, load, on_device

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import sm_coverage, sm_hook
from vllm_dualgpu.kernels.sm_coverage import ATTR_SYMBOL, SM_SYMBOL
from vllm_dualgpu.kernels.sm_hook import SmHookError, install_sm_hook, sm_hook_status

try:
    from vllm_dualgpu import _C
except ImportError:
    _C = None

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the fake libraries"),
    pytest.mark.skipif(_C is None, reason="extension not built (python setup.py build_ext --inplace)"),
]
try:
    import capstone  # noqa: F401

    HAVE_CAPSTONE = True
except ImportError:
    HAVE_CAPSTONE = False
needs_capstone = pytest.mark.skipif(not HAVE_CAPSTONE, reason="the coverage analysis needs capstone")

LIKE_033 = r"""
extern "C" int cudaDeviceGetAttribute(int* value, int attr, int device);
int get_sm_version_num() {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, 75, 0);
    cudaDeviceGetAttribute(&minor, 76, 0);
    return major * 10 + minor;
}
static inline __attribute__((always_inline)) int sm_inline() {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, 75, 0);
    cudaDeviceGetAttribute(&minor, 76, 0);
    return major * 10 + minor;
}
extern "C" __attribute__((noinline)) void fake_sink(int) { asm volatile(""); }
extern "C" int fake_dispatch_a() { return sm_inline(); }
extern "C" int fake_dispatch_b() {
    int first = sm_inline();
    fake_sink(first);
    int second = sm_inline();
    return first * 1000 + second;
}
extern "C" int fake_error_path() { return get_sm_version_num(); }
extern "C" int fake_query_device(int device) {
    int major = 0;
    cudaDeviceGetAttribute(&major, 75, device);
    return major;
}
extern "C" int fake_sm_count() {
    int count = 0;
    cudaDeviceGetAttribute(&count, 16, 0);
    return count;
}
"""

LIKE_030 = r"""
extern "C" int cudaDeviceGetAttribute(int* value, int attr, int device);
int get_sm_version_num() {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, 75, 0);
    cudaDeviceGetAttribute(&minor, 76, 0);
    return major * 10 + minor;
}
extern "C" int fake_dispatch_a() { return get_sm_version_num(); }
extern "C" int fake_dispatch_b() { return get_sm_version_num() + 1; }
"""

VARIANTS = {
    "libfake033_plain.so": (LIKE_033, ["-Wl,-z,lazy"]),  # never hooked: stock behaviour
    "libfake033_lazy.so": (LIKE_033, ["-Wl,-z,lazy"]),
    "libfake033_now.so": (LIKE_033, ["-Wl,-z,now", "-Wl,-z,relro"]),
    "libfake033_noplt.so": (LIKE_033, ["-fno-plt", "-Wl,-z,now"]),  # calls through GLOB_DAT
    "libfake033_pairs.so": (LIKE_033, ["-Wl,-z,lazy"]),
    "libfake030.so": (LIKE_030, ["-Wl,-z,lazy"]),
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake033")
    cudart_path, cudart = fake_cudart()
    out = {"cudart": cudart}
    for name, (source, flags) in VARIANTS.items():
        so = build(d, name, source, flags, cudart_path)
        out[name] = (str(so), load(so))
    return out


def objdump_calls(path: str) -> dict:
    """{(callee, esi constant or None): call addresses} from objdump, in the fakes' functions;
    a cudaDeviceGetAttribute call is keyed by the ``mov $imm,%esi`` before it in the same
    function when ``xor %edx,%edx`` came before it too (device 0), else by None."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True).stdout
    out: dict = {}
    esi = edx = None
    function = None
    for line in text.splitlines():
        if line.endswith(">:"):
            function, esi, edx = line.split("<")[1][:-2], None, None
        elif "xor    %edx,%edx" in line:
            edx = 0
        elif line.endswith(",%edx"):
            edx = None
        elif "mov    $0x4b,%esi" in line:
            esi = 0x4B
        elif "mov    $0x4c,%esi" in line:
            esi = 0x4C
        elif ("\tcall " in line or "\tjmp " in line) and "@plt>" in line and (function or "").startswith("fake_"):
            callee = line.split("<")[1].rstrip(">")
            device_zero = callee.startswith("cudaDeviceGetAttribute") and edx == 0
            key = (callee, esi if device_zero else None)
            out.setdefault(key, set()).add(int(line.split(":")[0], 16))
            esi = edx = None
    return out


def slot_values(path: str) -> dict:
    return {s: list(_C.plt_slots(path, s)["targets"]) for s in (SM_SYMBOL, ATTR_SYMBOL)}


def test_without_the_hook_inlined_queries_answer_for_device_zero(libs):
    _, lib = libs["libfake033_plain.so"]
    cudart = libs["cudart"]
    assert [on_device(lib.fake_dispatch_a, cudart, d) for d in (0, 1, 2)] == [89, 89, 89]
    assert on_device(lib.fake_dispatch_b, cudart, 1) == 89089
    assert on_device(lib.fake_error_path, cudart, 1) == 89


@needs_capstone
def test_coverage_of_the_033_layout_is_exact(libs):
    path, lib = libs["libfake033_lazy.so"]
    cov = sm_coverage.analyse(path)
    assert cov.total == 4 and cov.covered == 4
    assert len(cov.sm_calls) == 1 and cov.sm_calls[0].function == "fake_error_path"
    assert len(cov.inlined) == 3 and len(cov.minor) == 3
    assert sorted(q.function for q in cov.inlined) == ["fake_dispatch_a", "fake_dispatch_b", "fake_dispatch_b"]
    assert all(q.route == "plt" and q.attribute == 75 and q.device == 0 for q in cov.inlined)
    # get_sm_version_num's own two calls are its body, not queries; fake_query_device's is left.
    assert len(cov.body) == 2 and cov.other_capability == 1
    assert set(cov.slots) == {SM_SYMBOL, ATTR_SYMBOL}
    # The call sites found are the calls objdump shows.
    if shutil.which("objdump"):
        calls = objdump_calls(path)
        assert {q.address for q in cov.inlined} == calls["cudaDeviceGetAttribute@plt", 0x4B]
        assert {q.address for q in cov.sm_calls} == calls[f"{SM_SYMBOL}@plt", None]
    assert cov.line().startswith("libfake033_lazy.so: 4 of 4 capability queries covered")
    # The 0.30-style hook alone covers only the call through get_sm_version_num's PLT slot.
    old = sm_coverage.analyse(path, hooked=(SM_SYMBOL,))
    assert (old.covered, old.total) == (1, 4)


@needs_capstone
def test_coverage_of_the_030_layout_is_exact(libs):
    path, _ = libs["libfake030.so"]
    cov = sm_coverage.analyse(path)
    assert (cov.covered, cov.total, len(cov.sm_calls), len(cov.inlined)) == (2, 2, 2, 0)
    assert {q.function for q in cov.sm_calls} == {"fake_dispatch_a", "fake_dispatch_b"}
    # On this layout either slot alone covers everything (the body asks through the import).
    assert sm_coverage.analyse(path, hooked=(SM_SYMBOL,)).covered == 2
    assert sm_coverage.analyse(path, hooked=(ATTR_SYMBOL,)).covered == 2
    assert sm_coverage.analyse(path, hooked=()).covered == 0


@needs_capstone
def test_coverage_never_claims_a_library_without_slots(libs):
    path, _ = libs["libfake033_noplt.so"]
    cov = sm_coverage.analyse(path)
    assert cov.total == 4 and cov.covered == 0 and not cov.ok
    assert all(q.route == "got" for q in cov.queries)
    assert "NOT covered: 0 of 4" in cov.line()


@needs_capstone
def test_the_cli_exits_non_zero_when_nothing_is_covered(libs, capsys):
    assert sm_hook.main(["--coverage", libs["libfake033_lazy.so"][0]]) == 0
    assert "4 of 4 capability queries covered" in capsys.readouterr().out
    assert sm_hook.main(["--coverage", libs["libfake033_noplt.so"][0]]) == 1
    assert "NOT covered" in capsys.readouterr().out
    assert sm_hook.main(["--coverage", str(libs["cudart"]._name)]) == 1  # no query at all
    assert sm_hook.main(["--coverage", "/nonexistent/lib.so"]) == 2
    assert "cannot analyse" in capsys.readouterr().out


@needs_capstone
def test_hook_answers_inlined_queries_for_the_current_device(libs):
    path, lib = libs["libfake033_lazy.so"]
    cudart = libs["cudart"]
    rank_summary.clear()
    report = install_sm_hook(library="libfake033_lazy")
    assert report.library == path
    assert report.rewritten == 1 and report.attribute.rewritten == 1
    assert report.attribute.new_target == _C.device_attribute_hook_address()
    assert slot_values(path) == {
        SM_SYMBOL: [_C.sm_version_hook_address()], ATTR_SYMBOL: [_C.device_attribute_hook_address()]
    }
    assert [on_device(lib.fake_dispatch_a, cudart, d) for d in (0, 1, 2, 1)] == [89, 120, 90, 120]
    assert on_device(lib.fake_dispatch_b, cudart, 2) == 90090
    assert on_device(lib.fake_error_path, cudart, 1) == 120
    # Not device-0 capability queries: passed through unchanged.
    assert on_device(lib.fake_query_device, cudart, 1, 2) == 9  # device 2 asked: 9.0's major
    # The shim cannot tell a hard-coded 0 from a computed one: device 0 asked from a thread on
    # device 1 hears device 1 (the documented trade-off, docs/sm-hook.md).
    assert on_device(lib.fake_query_device, cudart, 1, 0) == 12
    assert on_device(lib.fake_sm_count, cudart, 2) == 100  # attribute 16 of device 0, as asked
    fact = rank_summary.facts()["sm-hook"]
    assert fact.startswith("libfake033_lazy.so: 4 of 4 capability queries covered")
    assert f"{ATTR_SYMBOL}: 1 PLT slot rewritten" in fact and f"{SM_SYMBOL}: 1 PLT slot rewritten" in fact
    assert sm_hook_status(library="libfake033_lazy")["hooked"]
    again = install_sm_hook(library="libfake033_lazy")
    assert (again.rewritten, again.already, again.attribute.rewritten, again.attribute.already) == (0, 1, 0, 1)


@needs_capstone
def test_hook_on_a_read_only_got(libs):
    path, lib = libs["libfake033_now.so"]
    report = install_sm_hook(library="libfake033_now")
    assert report.binding == "now" and report.attribute.read_only is True
    assert on_device(lib.fake_dispatch_a, libs["cudart"], 1) == 120
    assert "read-only GOT page" in report.summary()


@needs_capstone
def test_nothing_is_written_when_nothing_would_be_covered(libs):
    path, lib = libs["libfake033_noplt.so"]
    before = open("/proc/self/maps").read().count(path)  # the library is loaded
    assert before > 0
    with pytest.raises(SmHookError, match="NOT covered: 0 of 4 capability queries.*nothing was rewritten"):
        install_sm_hook(library="libfake033_noplt")
    assert on_device(lib.fake_dispatch_a, libs["cudart"], 1) == 89  # still stock
    assert not sm_hook_status(library="libfake033_noplt")["hooked"]


def test_all_slots_or_none(libs):
    # The second pair is refused (target 0) after the first pair's slot was found: the native
    # install checks every pair before it writes, so the first slot keeps its target.
    path, lib = libs["libfake033_pairs.so"]
    before = slot_values(path)
    with pytest.raises(ValueError, match=f"target address for {ATTR_SYMBOL} is 0"):
        _C.plt_hook_all(path, [(SM_SYMBOL, _C.sm_version_hook_address()), (ATTR_SYMBOL, 0)])
    assert slot_values(path) == before
    with pytest.raises(RuntimeError, match="no R_X86_64_JUMP_SLOT relocation for _Z8no_suchv"):
        _C.plt_hook_all(path, [("_Z8no_suchv", 1)])
    assert slot_values(path) == before
    assert on_device(lib.fake_dispatch_a, libs["cudart"], 1) == 89


def test_install_refuses_when_the_runtime_is_missing(libs, monkeypatch):
    def no_runtime(_path):
        raise RuntimeError("the CUDA runtime (cudaGetDevice, cudaDeviceGetAttribute) is not loaded")

    native = sm_hook._native()
    monkeypatch.setattr(native, "bind_cuda_runtime", no_runtime)
    path = libs["libfake033_pairs.so"][0]
    before = slot_values(path)
    with pytest.raises(SmHookError, match="CUDA runtime .* is not loaded"):
        install_sm_hook(library="libfake033_pairs")
    assert slot_values(path) == before
