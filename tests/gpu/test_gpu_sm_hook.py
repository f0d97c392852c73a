"""The native sm hook on a GPU (issue #4), in vLLM's loaded ``_C_stable_libtorch``: the PLT slot
of ``get_sm_version_num`` is rewritten once, answers each device's own capability, vLLM's
``cutlass_scaled_mm`` (which dispatches on it) is correct through it and reads the slot (a probe
answering 37 makes it refuse), and a second install rewrites nothing. One GPU is enough; with two,
each device is asked from a thread of its own."""

from __future__ import annotations

import pytest

from gpu_harness import assert_ran, gpu_out, needs_gpus, run_llm  # noqa: F401

PROBE = 37  # no kernel exists for it: the op must refuse


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


def per_device(devices, fn) -> dict:
    """fn(device) in one thread per device, that device current there; results or error text."""
    import threading

    import torch

    results: dict = {}

    def work(d):
        try:
            torch.cuda.set_device(d)
            torch.zeros(1, device=f"cuda:{d}")
            results[d] = fn(d)
        except Exception as exc:
            results[d] = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    threads = [threading.Thread(target=work, args=(d,)) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def hook_on_gpu(_llm=None) -> dict:
    import ctypes

    import torch
    import vllm._C_stable_libtorch  # noqa: F401  (what vLLM's CUDA platform loads)

    from vllm_dualgpu import _C
    from vllm_dualgpu.kernels.sm_hook import install_sm_hook, sm_hook_status

    devices = list(range(min(torch.cuda.device_count(), 2)))
    expected = {d: (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability(d)) for d in devices}
    slot = sm_hook_status()["slots"][0]
    through_slot = lambda d: ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.c_uint64.from_address(slot).value)()  # noqa: E731
    report = install_sm_hook()
    res = {"expected": expected, "rewritten": report.rewritten, "summary": report.summary(),
           "slot": per_device(devices, through_slot), "native": per_device(devices, lambda d: _C.sm_version_current_device()),
           "scaled_mm_error": per_device(devices, scaled_mm_error)}
    probe = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: PROBE)
    probe_addr = ctypes.cast(probe, ctypes.c_void_p).value
    install_sm_hook(target=probe_addr)
    res["probed"] = per_device(devices, scaled_mm_error)
    again, twice = install_sm_hook(), install_sm_hook()
    res["reinstall"] = {"rewritten": again.rewritten, "replaced_probe": again.old_targets == (probe_addr,)}
    res["idempotent"] = {"rewritten": twice.rewritten, "already": twice.already}
    res["hooked"] = sm_hook_status()["hooked"]
    return res


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_hook_answers_each_device_and_vllm_dispatch_reads_it(gpu_out, record_property):
    res = run_llm(None, hook_on_gpu, log=gpu_out / "sm_hook.log", timeout=120)
    assert_ran(res)
    record_property("hook", res["summary"])
    assert res["rewritten"] == 1, f"expected one PLT slot rewritten: {res['summary']}"
    assert res["slot"] == res["expected"], f"through the slot {res['slot']}, capability {res['expected']}"
    assert res["native"] == res["expected"], f"native per-device answer {res['native']}, capability {res['expected']}"
    for d, err in res["scaled_mm_error"].items():
        assert isinstance(err, float) and err < 0.25, f"cutlass_scaled_mm on GPU {d} through the hook: {err}"
    for d, outcome in res["probed"].items():
        assert isinstance(outcome, str) and ("capability: 37" in outcome or "compute capability less than" in outcome), \
            f"GPU {d}: with the slot answering {PROBE} the op did not refuse: {outcome}"
    assert res["reinstall"] == {"rewritten": 1, "replaced_probe": True}, res["reinstall"]
    assert res["idempotent"] == {"rewritten": 0, "already": 1}, res["idempotent"]
    assert res["hooked"], "the hook is not in place at the end"
