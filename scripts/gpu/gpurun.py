"""Helpers for GPU-machine scripts: process groups, log waits, ballast, NVML sampling."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 1024**3


def gdn_prefill_config() -> dict:
    """``additional_config`` for hybrid (GDN) models: the same GDN prefill kernel in every run.

    vLLM picks FlashInfer's on SM 9.0, which needs the CuTe DSL (nvidia-cutlass-dsl); Triton's
    runs wherever vLLM does. ``GDN_PREFILL_BACKEND`` overrides.
    """
    return {"gdn_prefill_backend": os.environ.get("GDN_PREFILL_BACKEND", "triton")}


def require_cuda_platform() -> None:
    """Refuse a real GPU child whose environment names vLLM's CPU platform.

    CPU tests set ``VLLM_TARGET_DEVICE=cpu`` (tests/conftest.py); a GPU child that inherits it
    would boot vLLM's CPU platform and fail deep in engine start-up ("'_C' object has no
    attribute 'init_cpu_memory_env'"). Say so at once instead.
    """
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        raise RuntimeError("VLLM_TARGET_DEVICE=cpu is set, so vLLM would pick its CPU platform for "
                           "this GPU run; unset it (only --dry-run uses the CPU platform)")


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start cmd in its own process group, stdout+stderr to log (never a pipe)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "w")
    # PYTHONFAULTHANDLER: on SIGABRT every Python process of the group (vLLM's engine and
    # workers included) writes its threads' stacks to the log; kill(dump=True) uses that.
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                            env={"PYTHONFAULTHANDLER": "1", **os.environ, **(env or {}),
                                 # `python -m` must not import this checkout (no built extension)
                                 # instead of the installed package: no cwd on sys.path.
                                 "PYTHONSAFEPATH": "1"})


def kill(p: subprocess.Popen, grace: float = 5.0, dump: bool = False) -> None:
    """End p's process group; dump=True first has every process write its stacks (a hang)."""
    if p.poll() is not None and not _group_alive(p.pid):
        return
    if dump:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGABRT)
        time.sleep(3.0)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        end = time.time() + wait
        while time.time() < end and _group_alive(p.pid):
            p.poll()  # reap our direct child
            time.sleep(0.2)
    with contextlib.suppress(Exception):
        p.wait(timeout=1)


RUNNING: list[subprocess.Popen] = []  # a script's running children, for its exit and signal handlers


def kill_running(*_) -> None:
    """Kill every child in RUNNING (a script adds its child while it runs and removes it after)."""
    for proc in list(RUNNING):
        kill(proc, grace=3)


def kill_running_on_exit() -> None:
    """At exit and on SIGTERM/SIGINT/SIGHUP (a stage limit, Ctrl-C), take RUNNING down first."""
    import atexit

    atexit.register(kill_running)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: (kill_running(), sys.exit(128 + s)))


def arms_main(doc: str, arms, *, timeout: float, dry_help: str, prepare, reuse, dry_run, child, parent) -> int:
    """The command line of the scripts that run vLLM arms in children:
    ``OUTDIR [--dry-run] [--timeout S]``; ``--child ARM`` (internal) runs one arm.

    ``prepare(out)`` writes the inputs (a child reuses them: ``reuse(out)``); then
    ``dry_run(out, inputs)``, ``child(out, inputs, arm)`` or ``parent(out, inputs, timeout)``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true", help=dry_help)
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds for the vLLM children together")
    ap.add_argument("--child", choices=sorted(arms), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    inputs = reuse(out) if args.child else prepare(out)
    if args.dry_run:
        return dry_run(out, inputs)
    if args.child:
        require_cuda_platform()
        return child(out, inputs, args.child)
    return parent(out, inputs, args.timeout)


def registry_entry(name: str) -> dict:
    """The plugin registry's patch ``name``: its target, processes, and whether the target exists."""
    import importlib

    from vllm_dualgpu.patching.registry import PATCHES

    p = next(p for p in PATCHES if p.name == name)
    mod, attr = p.target.split(":")
    owner = importlib.import_module(mod)
    for part in attr.split("."):
        owner = getattr(owner, part)
    return {"target": p.target, "processes": list(p.processes), "target_exists": callable(owner)}


def applied_names(line: str) -> list[str]:
    """The patches a plugin line lists as applied ("...: applied a, b; skipped c (why)")."""
    m = re.search(r"\): applied (.*?); skipped ", line) or re.search(r"\): applied (.*)$", line)
    return [n.split(" (")[0].strip() for n in m.group(1).split(", ")] if m else []


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies, waiting to be reaped, do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def wait_for(log: Path, pattern: str, timeout: float, proc: subprocess.Popen | None = None,
             fail_pattern: str | None = None) -> str | None:
    """Wait until a line matching pattern appears; None on timeout, exit or fail_pattern."""
    rx, frx = re.compile(pattern), re.compile(fail_pattern) if fail_pattern else None
    end = time.time() + timeout
    while time.time() < end:
        text = log.read_text(errors="replace") if log.exists() else ""
        m = rx.search(text)
        if m:
            return m.group(0)
        if frx and frx.search(text):
            return None
        if proc is not None and proc.poll() is not None:
            text = log.read_text(errors="replace")
            m = rx.search(text)
            return m.group(0) if m else None
        time.sleep(0.5)
    return None


class NvmlSampler:
    """Samples used memory of every GPU every `period` s; .peak[i] is the highest seen."""

    def __init__(self, period: float = 0.25):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.period = period
        self.peak = [0] * len(self.handles)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def used(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]

    def _run(self):
        while not self._stop.is_set():
            for i, u in enumerate(self.used()):
                self.peak[i] = max(self.peak[i], u)
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.used()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


@contextlib.contextmanager
def ballast(free_gib: list[float | None], logdir: Path):
    """Leave free_gib[i] GiB free on GPU i (None: leave it alone) for the duration."""
    procs = []
    try:
        for gpu, free in enumerate(free_gib):
            if free is None:
                continue
            ready = logdir / f"ballast{gpu}.ready"
            ready.unlink(missing_ok=True)
            procs.append(start([sys.executable, str(HERE / "ballast.py"), str(gpu), str(free), str(ready)],
                               logdir / f"ballast{gpu}.log"))
            end = time.time() + 120
            while not ready.exists() and time.time() < end:
                time.sleep(0.2)
            if not ready.exists():
                raise RuntimeError(f"ballast on GPU {gpu} did not get ready")
        yield
    finally:
        for p in procs:
            kill(p, grace=1)


def grep(log: Path, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [l for l in log.read_text(errors="replace").splitlines() if rx.search(l)]


# --- scripts whose vLLM arms run in children (vision_pp, embed_quant_pp) ----------------------


def run_child(script: Path, out: Path, arm: str, timeout: float, env: dict | None = None,
              sample_memory: bool = False) -> dict:
    """Run ``script OUT --child ARM`` in its own process group (log: OUT/ARM-llm.log) until it
    writes OUT/ARM-child.json (:func:`write_child_result`), exits or reaches ``timeout``; then
    kill the group. Returns what happened, the child's result and the log's plugin lines."""
    result_file, log = out / f"{arm}-child.json", out / f"{arm}-llm.log"
    result_file.unlink(missing_ok=True)
    res: dict = {}
    sampler = None
    if sample_memory:
        try:
            sampler = NvmlSampler().__enter__()
        except Exception as exc:  # memory is informational
            res["nvml_error"] = repr(exc)
    t0 = time.time()
    proc = start([sys.executable, str(script), str(out), "--child", arm], log, env=env)
    RUNNING.append(proc)
    try:
        while time.time() - t0 < timeout and proc.poll() is None and not result_file.exists():
            time.sleep(0.25)
        res["timed_out"] = not result_file.exists() and proc.poll() is None
        res["child_rc"] = proc.poll()
    finally:
        kill(proc, grace=3)
        RUNNING.remove(proc)
        if sampler is not None:
            sampler.__exit__(None, None, None)
            res["peak_device_used_gib"] = [round(b / 1024**3, 3) for b in sampler.peak]
    res["wall_s"] = round(time.time() - t0, 1)
    res["child"] = json.loads(result_file.read_text()) if result_file.exists() else None
    res["plugin_lines"] = grep(log, r"vllm-dualgpu \d+\.\d+\.\d+ \(")
    res["rank_lines"] = grep(log, r"vllm-dualgpu rank \d+/\d+: ")
    res["errors"] = grep(log, r"Traceback|Error|error:")[:20]
    return res


def workers_by_rank(res: dict) -> dict[int, dict]:
    """The child's per-worker probe results (``collective_rpc``), by PP rank."""
    return {w["pp_rank"]: w for w in (res.get("child") or {}).get("workers") or []}


def attempt(fn) -> dict:
    """``fn()``, or {"error": ...} when it raises: a dry run reports every step it could not take."""
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:1500]}


def write_child_result(out: Path, arm: str, res: dict, t0: float) -> None:
    """A child's last act: OUT/ARM-child.json written atomically (the parent stops waiting once it
    exists), then exit without the engine's shutdown (the parent ends the whole group)."""
    res["total_s"] = round(time.time() - t0, 1)
    tmp = out / f"{arm}-child.json.tmp"
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(out / f"{arm}-child.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
