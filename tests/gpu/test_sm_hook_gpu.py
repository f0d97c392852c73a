"""The sm hook in a real vLLM CUDA process (GPU machine: ``pytest -m gpu tests/gpu/test_sm_hook_gpu.py``).

Loads vLLM's ``_C_stable_libtorch`` as vLLM's CUDA platform does, installs the hook, and checks
on every visible device that the queries the library makes through its own slots answer that
device's capability; on a library that inlines the queries (vLLM 0.32+) it also shows that
``cutlass_scaled_mm``'s dispatch reads the rewritten ``cudaDeviceGetAttribute`` slot (pointed at
a probe answering 3.7, the op refuses naming 37).
"""

from __future__ import annotations

import ctypes

import pytest

pytestmark = pytest.mark.gpu

ATTR_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)


@pytest.fixture(scope="module")
def hooked():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available()
    import vllm._C_stable_libtorch  # noqa: F401  (what vLLM's CUDA platform imports)

    from vllm_dualgpu.kernels.sm_hook import install_sm_hook, sm_hook_status

    torch.cuda.set_device(0)
    report = install_sm_hook()
    return torch, report, sm_hook_status()


def through_slot(slot: int, attr: int) -> int:
    """cudaDeviceGetAttribute(&v, attr, 0) through the library's own GOT slot."""
    value = ctypes.c_int(-1)
    assert ATTR_FN(ctypes.c_uint64.from_address(slot).value)(ctypes.byref(value), attr, 0) == 0
    return value.value


def test_the_hook_covers_the_installed_vllm(hooked):
    _, report, status = hooked
    print(report.summary())
    assert report.coverage is not None, report.coverage_error
    assert report.coverage.covered > 0 and report.coverage.covered == report.coverage.total
    assert status["hooked"] and status["attribute_slots"]


def test_queries_through_the_slots_answer_the_current_device(hooked):
    torch, _, status = hooked
    from vllm_dualgpu import _C

    slot = status["attribute_slots"][0]
    for device in range(torch.cuda.device_count()):
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")
        major, minor = torch.cuda.get_device_capability(device)
        assert (through_slot(slot, 75), through_slot(slot, 76)) == (major, minor)
        assert _C.sm_version_current_device() == major * 10 + minor
        if status["slots"]:  # get_sm_version_num's own slot
            fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.c_uint64.from_address(status["slots"][0]).value)
            assert fn() == major * 10 + minor
    torch.cuda.set_device(0)


def test_inlined_dispatch_reads_the_attribute_slot(hooked):
    torch, report, status = hooked
    if not report.coverage.inlined:
        pytest.skip("this vLLM calls get_sm_version_num through its PLT (no inlined queries)")
    from vllm_dualgpu import _C
    from vllm_dualgpu.kernels.sm_hook import install_sm_hook

    real = ctypes.CDLL(report.cuda_runtime).cudaDeviceGetAttribute
    real.argtypes, real.restype = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int], ctypes.c_int

    def probe(value, attr, device):
        if attr in (75, 76):
            value[0] = 3 if attr == 75 else 7
            return 0
        return real(value, attr, device)

    callback = ATTR_FN(probe)
    address = ctypes.cast(callback, ctypes.c_void_p).value
    dev = "cuda:0"
    a = torch.zeros(16, 128, device=dev).to(torch.float8_e4m3fn)
    b = torch.zeros(128, 128, device=dev).to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(16, 1, device=dev), torch.ones(1, 128, device=dev)
    out = torch.empty(16, 128, dtype=torch.bfloat16, device=dev)
    torch.ops._C.cutlass_scaled_mm(out, a, b, sa, sb, None)  # runs with the hook in place
    _C.plt_hook_all(report.library, [("cudaDeviceGetAttribute", address)])
    try:
        with pytest.raises(Exception, match="37"):
            torch.ops._C.cutlass_scaled_mm(out, a, b, sa, sb, None)
    finally:
        again = install_sm_hook()
    assert again.attribute.rewritten == 1 and again.attribute.old_targets == (address,)
    torch.ops._C.cutlass_scaled_mm(out, a, b, sa, sb, None)


def scaled_mm_error(device: int) -> float:
    """vLLM's cutlass_scaled_mm on ``device`` against float math: the largest absolute error."""
    import torch

    dev = f"cuda:{device}"
    torch.manual_seed(device)
    m, k, n = 16, 128, 128
    a = (torch.randn(m, k, device=dev) / 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device=dev) / 4).to(torch.float8_e4m3fn).t()  # column-major K x N
    sa, sb = torch.full((m, 1), 0.5, device=dev), torch.full((1, n), 2.0, device=dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    torch.ops._C.cutlass_scaled_mm(out, a, b, sa, sb, None)
    return (out.float() - (a.float() * sa) @ (b.float() * sb)).abs().max().item()


def test_vllms_scaled_mm_is_correct_through_the_hook(hooked):
    """The dispatch the hook steers still picks a kernel that computes the right product."""
    torch = hooked[0]
    for d in range(min(torch.cuda.device_count(), 2)):
        torch.cuda.set_device(d)
        err = scaled_mm_error(d)
        assert err < 0.25, f"cutlass_scaled_mm on GPU {d} through the hook: largest error {err}"
    torch.cuda.set_device(0)
