#!/usr/bin/env python3
"""GPU check of the native sm hook (issue #4): vLLM's compiled library, per device, before/after.

    python scripts/gpu/check_sm_hook.py OUT_DIR

In one process, with one thread per visible GPU (at most two), each thread making its GPU the
current device:

1. loads vLLM's ``_C_stable_libtorch`` and reads ``get_sm_version_num`` through the library's
   own PLT slot (the path all 27 call sites take), per device: stock answers device 0;
2. installs the hook (``install_sm_hook()``) and prints its report;
3. reads through the slot again and calls the native per-device function, per device, and
   compares with ``torch.cuda.get_device_capability`` (H200: 90);
4. runs ``torch.ops._C.cutlass_scaled_mm`` (which dispatches on ``get_sm_version_num``) on each
   device with the hook in place, against a float reference;
5. proves the op's dispatch reads the slot: points the slot at a probe answering 37 and expects
   the op's "no kernel for a compute capability less than ... 37" error, then reinstalls the hook (and once more: idempotent).

Writes ``OUT_DIR/sm_hook.json`` and prints a summary; exit status 0 when every check passed.
Takes well under a minute (torch + CUDA init + one library load).
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
import traceback
from pathlib import Path

PROBE = 37  # no kernel exists for it: the op must refuse naming this number


def _refused_for_probe(text) -> bool:
    text = str(text)
    return text.startswith("refused") and (
        f"capability: {PROBE}" in text or "for a compute capability less than" in text
    )


def hx(v):
    return None if v is None else f"0x{v:x}"


def call_int(address: int) -> int:
    """Call an `int f(void)` at `address` (a PLT slot's target) from this thread."""
    return ctypes.CFUNCTYPE(ctypes.c_int)(address)()


def per_device(devices, fn):
    """fn(device) in one thread per device, concurrently; {device: result or error text}."""
    import torch

    results: dict = {}
    barrier = threading.Barrier(len(devices))

    def work(d):
        try:
            torch.cuda.set_device(d)
            torch.zeros(1, device=f"cuda:{d}")  # make the device's context current in this thread
            barrier.wait(timeout=30)
            results[d] = fn(d)
        except Exception as exc:  # recorded, not raised: the JSON says what failed where
            results[d] = f"ERROR {type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=work, args=(d,)) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {str(d): results.get(d) for d in devices}


def scaled_mm(device: int) -> dict:
    """vLLM's cutlass_scaled_mm on `device`, checked against float math."""
    import torch

    dev = f"cuda:{device}"
    torch.manual_seed(device)
    m, k, n = 16, 128, 128
    a = (torch.randn(m, k, device=dev) / 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device=dev) / 4).to(torch.float8_e4m3fn).t()  # column-major K x N
    sa = torch.full((m, 1), 0.5, device=dev)
    sb = torch.full((1, n), 2.0, device=dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    torch.ops._C.cutlass_scaled_mm(out, a, b, sa, sb, None)
    ref = (a.float() * sa) @ (b.float() * sb)
    err = (out.float() - ref).abs().max().item()
    return {"ok": err < 0.25, "max_abs_err": round(err, 4)}


def run(res: dict, out_dir: Path) -> None:
    import torch

    t = time.time()
    n = torch.cuda.device_count()
    devices = list(range(min(n, 2)))
    if not devices:
        raise RuntimeError("no CUDA device visible")
    expected = {str(d): torch.cuda.get_device_capability(d) for d in devices}
    expected = {d: c[0] * 10 + c[1] for d, c in expected.items()}
    res["devices"] = {str(d): torch.cuda.get_device_name(d) for d in devices}
    res["expected_sm"] = expected

    import vllm._C_stable_libtorch  # noqa: F401  (what vLLM's CUDA platform imports)

    from vllm_dualgpu import _C
    from vllm_dualgpu.kernels.sm_hook import SYMBOL, install_sm_hook, sm_hook_status

    res["setup_s"] = round(time.time() - t, 1)
    before = sm_hook_status()
    res["status_before"] = {**before, "targets": [hx(x) for x in before["targets"]],
                            "slots": [hx(x) for x in before["slots"]],
                            "hook_address": hx(before["hook_address"]), "definition": hx(before["definition"])}
    if not before["slots"]:
        raise RuntimeError(f"no PLT slot found: {before['error']}")
    slot = before["slots"][0]
    lib = ctypes.CDLL(before["library"])  # the loaded library again (same handle)
    definition = ctypes.cast(getattr(lib, SYMBOL), ctypes.c_void_p).value
    slot_value = lambda: ctypes.c_uint64.from_address(slot).value  # noqa: E731

    # 1. stock: through the slot (lazy PLT stub or the resolved definition) and the definition
    res["before_through_slot"] = per_device(devices, lambda d: call_int(slot_value()))
    res["before_definition"] = per_device(devices, lambda d: call_int(definition))

    # 2. install
    report = install_sm_hook()
    res["report"] = {
        "library": report.library, "symbol": report.symbol, "slots": [hx(s) for s in report.slots],
        "old_targets": [hx(s) for s in report.old_targets], "new_target": hx(report.new_target),
        "rewritten": report.rewritten, "already": report.already, "read_only": report.read_only,
        "binding": report.binding, "definition": hx(report.definition),
        "cuda_runtime": report.cuda_runtime, "summary": report.summary(),
    }
    print("HookReport:", report.summary(), flush=True)

    # 3. after: through the slot, the native function, torch's view
    res["after_through_slot"] = per_device(devices, lambda d: call_int(slot_value()))
    res["after_native"] = per_device(devices, lambda d: _C.sm_version_current_device())

    # 4. a vLLM op that dispatches on get_sm_version_num, on each device, hook in place
    res["scaled_mm_hooked"] = per_device(devices, scaled_mm)

    # 5. the op's dispatch reads the slot: a probe target, then the hook again
    probe = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: PROBE)
    probe_addr = ctypes.cast(probe, ctypes.c_void_p).value
    install_sm_hook(target=probe_addr)

    def probed(d):
        try:
            scaled_mm(d)
            return "ran (the op did not read the slot)"
        except Exception as exc:  # vLLM's TORCH_CHECK: RuntimeError / NotImplementedError
            return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    res["scaled_mm_probe"] = per_device(devices, probed)
    again = install_sm_hook()
    twice = install_sm_hook()
    res["reinstall"] = {"rewritten": again.rewritten, "old_targets": [hx(x) for x in again.old_targets],
                        "probe": hx(probe_addr)}
    res["idempotent"] = {"rewritten": twice.rewritten, "already": twice.already}
    res["status_after"] = {"hooked": sm_hook_status()["hooked"], "slot_value": hx(slot_value())}

    checks = {
        "slot found": len(report.slots) >= 1,
        "rewritten once": report.rewritten == 1,
        "after == capability (slot)": res["after_through_slot"] == expected,
        "after == capability (native)": res["after_native"] == expected,
        "scaled_mm ok on each device": all(isinstance(v, dict) and v["ok"] for v in res["scaled_mm_hooked"].values()),
        # vLLM 0.30's message: "No compiled cutlass_scaled_mm for a compute capability less than
        # CUDA device capability: 37" (cut at 200 characters): the op refused only with the probe.
        "op reads the slot": all(_refused_for_probe(v) for v in res["scaled_mm_probe"].values()),
        "reinstall replaced the probe": again.rewritten == 1 and again.old_targets == (probe_addr,),
        "idempotent": twice.rewritten == 0 and twice.already == 1,
        "hooked at the end": res["status_after"]["hooked"],
    }
    res["checks"] = checks
    res["ok"] = all(checks.values())


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"ok": False}
    t0 = time.time()
    try:
        run(res, out_dir)
    except Exception:
        res["error"] = traceback.format_exc()
    res["seconds"] = round(time.time() - t0, 1)
    (out_dir / "sm_hook.json").write_text(json.dumps(res, indent=2, default=str))
    for key in ("devices", "expected_sm", "before_through_slot", "before_definition", "after_through_slot",
                "after_native", "scaled_mm_hooked", "scaled_mm_probe", "idempotent", "checks", "error"):
        if key in res:
            print(f"{key}: {json.dumps(res[key], default=str)}")
    print(f"RESULT ok={res['ok']} in {res['seconds']} s", flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
