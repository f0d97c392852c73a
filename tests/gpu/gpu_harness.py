"""What the GPU tests and benchmarks share: processes in a group of their own and the one way to end
them, ballast (memory held by another process: a smaller card), ``vllm.LLM`` in a fresh process,
``vllm serve`` as a context (after vLLM's RemoteOpenAIServer), the plugin's log lines, fixtures.
Children run without ``VLLM_TARGET_DEVICE`` (the CPU tests' ``cpu``) and with ``PYTHONSAFEPATH=1``
(the installed package, with its extension, not this checkout). ``python gpu_harness.py ballast
GPU FREE_GIB READY`` is the ballast."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

GiB = 1024**3
HERE = Path(__file__).resolve().parent
PLUGIN_LINE = r"vllm-dualgpu \d+\.\d+\.\d+ \("
RANK_LINE = r"vllm-dualgpu rank \d+/\d+: "


# --- GPUs ---------------------------------------------------------------------------------------


def gpu_count() -> int:
    """GPUs NVML sees (0 without a driver or without pynvml)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def needs_gpus(n: int):
    """Mark a test ``gpu`` and skip it, with the reason, when NVML sees fewer than ``n`` GPUs."""
    seen = gpu_count()

    def mark(fn):
        fn = pytest.mark.gpu(fn)
        return pytest.mark.skipif(seen < n, reason=f"needs {n} NVIDIA GPU{'s' * (n > 1)}; NVML sees {seen}")(fn)

    return mark


# --- a mismatched pair: two GPUs with ballast, or a virtual pair on one ---------------------------

VIRTUAL_PAIR_ENV = "DUALGPU_VIRTUAL_PAIR"
# A session's first boot of a Gated DeltaNet model compiles and autotunes Triton's GDN prefill
# kernels in each rank: on a fresh H200 the vision model's plugin run was still doing so when its
# 200 s limit ended it (twenty-first session, docs/gpu-runs.md), where a warm one booted in ~100 s.
FIRST_GDN_BOOT_S = 420
"""Set to a VLLM_DUALGPU_VIRTUAL_GPUS value to use that virtual pair even with two GPUs."""


def virtual_spec(free_gib: list[float] | None = None) -> str:
    """The virtual pair for ``free_gib`` (GiB free per card, in the order the plugin sees them):
    the smallest is an RTX 4070 Ti SUPER, the others H200s; default 16 + 32 GiB."""
    free_gib = free_gib or [16.0, 32.0]
    small = min(free_gib)
    return ",".join(f"{'RTX 4070 Ti SUPER' if f == small else 'NVIDIA H200'}:{f:g}GiB" for f in free_gib)


def uses_virtual_pair() -> bool:
    return bool(os.environ.get(VIRTUAL_PAIR_ENV)) or gpu_count() == 1


def pair_env(free_gib: list[float] | None = None) -> dict:
    """What a PP=2 child adds to its environment: nothing on two GPUs; on one, the virtual pair
    (VLLM_DUALGPU_VIRTUAL_GPUS, docs/virtual-gpus.md) and spawned workers."""
    if not uses_virtual_pair():
        return {}
    return {"VLLM_DUALGPU_VIRTUAL_GPUS": os.environ.get(VIRTUAL_PAIR_ENV) or virtual_spec(free_gib),
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def needs_pair():
    """Mark a PP=2 test ``gpu``: it runs on two GPUs, or on one as a virtual pair; skipped
    without a GPU."""
    seen = gpu_count()

    def mark(fn):
        fn = pytest.mark.gpu(fn)
        return pytest.mark.skipif(seen < 1, reason=f"needs an NVIDIA GPU (two, or one as a virtual pair); NVML sees {seen}")(fn)

    return mark


@contextlib.contextmanager
def pair(free_gib: list[float], logdir: Path):
    """The pair of ``free_gib`` while the block runs; yields the child's extra environment:
    ballast on two GPUs, the virtual pair's variables on one."""
    if uses_virtual_pair():
        yield pair_env(free_gib)
        return
    with ballast(free_gib, logdir):
        yield {}


# --- process groups: start, end (the one cleanup) -----------------------------------------------

RUNNING: set[int] = set()  # process groups started here and not yet ended


JIT_KERNELS_ENV = "DUALGPU_GPU_JIT_KERNELS"
"""Set to 1 to leave vLLM's kernel choice alone (PRECOMPILED_KERNELS not applied)."""
PRECOMPILED_KERNELS = {
    # vLLM 0.33 picks kernels that are built or warmed up on first use: FlashInfer's SM90 block-FP8 GEMM
    # (fp8_blockscale_gemm_90) and humming's. On a fresh GPU machine each build took longer than
    # the 2-4 minutes left in the call (seen on the 14B FP8 and the headline models); vLLM then
    # takes CUTLASS, Marlin or Machete, which ship built. Every child gets the same choice, so
    # stock and plugin arms stay comparable.
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
    # DeepGEMM (SM 9.0 / 10.x only): neither reference card (SM 8.9, 12.0) runs it, and on the H200
    # its warmup after the KV cache outlasted a call (twelfth session). vLLM takes CUTLASS instead.
    "VLLM_USE_DEEP_GEMM": "0",
    # FlashInfer's top-k/top-p sampler: built on first use (2 minutes of a headline arm's boot,
    # thirteenth session); vLLM samples with PyTorch instead.
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_DISABLED_KERNELS": ",".join(("HummingFP8ScaledMMLinearKernel", "HummingInt8ScaledMMLinearKernel",
                                       "HummingLinearKernel", "HummingNvFp4LinearKernel")),
}


VIRTUAL_PAIR_ATTENTION = "TRITON_ATTN"
VIRTUAL_PAIR_ENCODER_ATTENTION = "TORCH_SDPA"  # a vision encoder's: vLLM lists FLASH_ATTN first on SM 8.0+


def virtual_pair_attention(env: dict | None, chosen: str | None, kv_cache_dtype: str | None) -> str | None:
    """The attention backend of a child on a virtual pair when the test chose none.

    A rank that presents SM 8.9 on the H200 makes vLLM take FlashAttention 2 for a 16-bit KV cache,
    and vLLM 0.33's FA2 library ships SM 8.0 code only (cubins and PTX for sm_80): the driver
    compiles each FA2 kernel from PTX on its first launch, CPU-bound, a minute or more a kernel. On
    the GPU (2026-12-02) every first request waited on it (rank 0's thread running, the GPU idle)
    while the same server with TRITON_ATTN answered in 1.8 s. A real SM 8.9 card runs the sm_80
    cubins as they are, so this is the emulation's cost, not the plugin's: virtual-pair children
    take Triton attention, and a vision encoder PyTorch's SDPA (``VIRTUAL_PAIR_ENCODER_ATTENTION``;
    DUALGPU_GPU_JIT_KERNELS=1 keeps vLLM's choice). An fp8 KV cache runs FlashInfer there (the
    executor sets it: the headline arms keep vLLM's choices), and a backend the test chose is kept."""
    if chosen or os.environ.get(JIT_KERNELS_ENV) == "1":
        return chosen
    virtual = (env or {}).get("VLLM_DUALGPU_VIRTUAL_GPUS") or os.environ.get("VLLM_DUALGPU_VIRTUAL_GPUS")
    if not virtual or str(kv_cache_dtype or "auto").startswith("fp8"):
        return None
    return VIRTUAL_PAIR_ATTENTION


def with_virtual_pair_attention(engine_kwargs: dict | None, env: dict | None) -> dict | None:
    """``vllm.LLM``'s arguments with :func:`virtual_pair_attention`'s backend where it names one."""
    if engine_kwargs is None or engine_kwargs.get("attention_backend"):
        return engine_kwargs
    backend = virtual_pair_attention(env, None, engine_kwargs.get("kv_cache_dtype"))
    if not backend:
        return engine_kwargs
    encoder = engine_kwargs.get("mm_encoder_attn_backend") or VIRTUAL_PAIR_ENCODER_ATTENTION
    return {**engine_kwargs, "attention_backend": backend, "mm_encoder_attn_backend": encoder}


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in a command line."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def kernel_env() -> dict:
    """The kernel settings every child starts with (an explicit value in its env wins)."""
    return {} if os.environ.get(JIT_KERNELS_ENV) == "1" else dict(PRECOMPILED_KERNELS)


TORCH_TOPK_ENV = "DUALGPU_GPU_TORCH_TOPK"
"""=1: every child's vLLM takes torch.topk for its vocab-parallel top-k, not FlashInfer's (whose JIT
build a GPU machine without FlashInfer's precompiled kernels waits on: torch_topk_site/)."""
TORCH_TOPK_SITE = Path(__file__).resolve().parent / "torch_topk_site"
TORCH_TOPK_LINE = "gpu-harness: torch top-k instead of FlashInfer's in pid"


def with_torch_topk(env: dict) -> dict:
    """``env`` with torch_topk_site/ first on PYTHONPATH where DUALGPU_GPU_TORCH_TOPK=1 (in ``env``
    or this process's environment), else ``env`` as it is."""
    if (env.get(TORCH_TOPK_ENV) or os.environ.get(TORCH_TOPK_ENV)) != "1":
        return env
    rest = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(TORCH_TOPK_SITE), rest) if p)}


def torch_topk_here() -> None:
    """Where DUALGPU_GPU_TORCH_TOPK=1: the torch top-k hook in this already running process, so that
    the processes it forks have it too (a spawned one gets it from PYTHONPATH, with_torch_topk)."""
    if os.environ.get(TORCH_TOPK_ENV) != "1" or "vllm_gpu_harness_torch_topk" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("vllm_gpu_harness_torch_topk", TORCH_TOPK_SITE / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    # On SIGABRT every Python process of the group writes its threads' stacks (stop_group(dump=True)).
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return with_torch_topk({**kernel_env(), **env, **(extra or {}), "PYTHONSAFEPATH": "1"})


def start_group(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``cmd`` as the leader of a new process group, stdout and stderr to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env=child_env(env))
    RUNNING.add(p.pid)
    return p


def members(pgid: int) -> list[int]:
    """Live processes of group ``pgid`` or of the session it leads (a process that moved to a
    group of its own stays in the session: start_group and run_llm's child start one). Zombies
    do not count: a leader not reaped yet, or members reparented to an init that never reaps."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if pgid in (int(fields[2]), int(fields[3])) and fields[0] != "Z":
            found.append(int(entry))
    return found


def group_alive(pgid: int) -> bool:
    """Whether a member of the group (or of the session it leads) still runs."""
    return bool(members(pgid))


def stop_group(pgid: int, grace: float = 5.0, dump: bool = False) -> None:
    """End process group ``pgid``: SIGTERM, then SIGKILL after ``grace`` s; ``dump=True`` first
    has every Python process write its stacks to its log (for a hang)."""
    if dump and group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGABRT)
        time.sleep(3.0)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not group_alive(pgid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        for pid in members(pgid):  # those that left the group but not the session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        end = time.time() + wait
        while time.time() < end and group_alive(pgid):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-pgid, os.WNOHANG)  # reap our own child, the leader
            time.sleep(0.1)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(-pgid, os.WNOHANG)
    RUNNING.discard(pgid)


def stop_all(*_) -> None:
    for pgid in list(RUNNING):
        stop_group(pgid, grace=2.0)


atexit.register(stop_all)


def on_signals_stop_all() -> None:
    """A script's SIGTERM/SIGINT/SIGHUP (a time limit, Ctrl-C) ends its groups first."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: (stop_all(), sys.exit(128 + s)))


# --- logs ----------------------------------------------------------------------------------------


def grep(log: Path, pattern: str) -> list[str]:
    rx = re.compile(pattern)
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if rx.search(line)]


def tail(log: Path, n: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    return "\n".join(text.splitlines()[-n:])


def applied_names(line: str) -> list[str]:
    """The patches a plugin line lists as applied ("...: applied a, b; skipped c (why)")."""
    m = re.search(r"\): applied (.*?); skipped ", line) or re.search(r"\): applied (.*)$", line)
    return [n.split(" (")[0].strip() for n in m.group(1).split(", ")] if m else []


def plugin_lines(log: Path, kind: str) -> list[str]:
    """The plugin lines of processes of ``kind`` (frontend, engine, worker)."""
    return [line for line in grep(log, PLUGIN_LINE) if re.search(rf"[(+]{kind}[,+ )]", line)]


def last_summaries(log: Path, kind: str) -> dict[str, str]:
    """Per process of ``kind`` (its pid), its last plugin line: a spawned worker logs one when it
    loads the plugin ("nothing applied yet") and another once the dualgpu worker has applied its
    patches."""
    found: dict[str, str] = {}
    for line in plugin_lines(log, kind):
        m = re.search(r"\(\S*, pid (\d+),", line)
        found[m.group(1) if m else line] = line
    return found


def patches_in_force(families, version: str | None = None) -> list[str]:
    """The registry's entries of ``families`` in force for ``version`` (default: the installed
    vLLM). A family is an entry's name, or that name with a release suffix ("-032" covers the
    releases whose target moved); a family fixed upstream for that release (for example
    vision-tower-first-rank-only from vLLM 0.33) gives no entry."""
    from vllm_dualgpu.patching.registry import for_version
    from vllm_dualgpu.plugin import installed_vllm_version

    version = version or installed_vllm_version()
    # one entry at most per family and release: tests/unit/patching/test_one_entry_per_family_and_release.py
    return [entry.name for family in families if (entry := for_version(family, version)) is not None]


def assert_applied(log: Path, kind: str, names, at_least: int = 1) -> None:
    """Each process of ``kind`` (at least ``at_least`` of them) lists ``names`` as applied in its
    last plugin line."""
    last = last_summaries(log, kind)
    assert len(last) >= at_least, f"{len(last)} {kind} processes logged a plugin line in {log.name}, expected {at_least}"
    for pid, line in last.items():
        missing = [n for n in names if n not in applied_names(line)]
        assert not missing, f"a {kind} process did not apply {missing} (pid {pid}; its last plugin line): {line}"


# the executor's lines naming a rank that ended or did not answer a step (engine/rank_faults.py);
# other plugin lines say "rank 0 on GPU 0" (the reserve) or "vllm-dualgpu rank 0/2:" (summaries)
DEAD_RANK_LINE = (r"vllm-dualgpu: (pipeline rank \d+|rank \d+ \(stage \d+, TP rank \d+\))( \(GPU \d+: [^)]*\))? "
                  r"(was killed by signal|exited with status) ")
UNANSWERED_LINE = r"vllm-dualgpu: no answer to \w+ within "


def rank_fault_lines(log: Path) -> dict[str, list[str]]:
    """The lines naming a dead rank ("dead") and an unanswered step ("unanswered"), without vLLM's
    log prefix."""
    def found(pattern: str) -> list[str]:
        return [line.split("] ", 1)[-1] for line in grep(log, pattern)]
    return {"dead": found(DEAD_RANK_LINE), "unanswered": found(UNANSWERED_LINE)}


# --- ballast -------------------------------------------------------------------------------------


@contextlib.contextmanager
def ballast(free_gib: list[float | None], logdir: Path):
    """Leave ``free_gib[i]`` GiB free on GPU i (None: leave it alone) while the block runs; each
    GPU's memory is held by a process of its own."""
    groups = []
    try:
        for gpu, free in enumerate(free_gib):
            if free is None:
                continue
            ready = logdir / f"ballast{gpu}.ready"
            ready.unlink(missing_ok=True)
            p = start_group([sys.executable, str(Path(__file__).resolve()), "ballast", str(gpu), str(free), str(ready)],
                            logdir / f"ballast{gpu}.log")
            groups.append(p.pid)
            end = time.time() + 120
            while not ready.exists() and time.time() < end and p.poll() is None:
                time.sleep(0.2)
            assert ready.exists(), f"ballast on GPU {gpu} did not get ready:\n{tail(logdir / f'ballast{gpu}.log')}"
        yield
    finally:
        for pgid in groups:
            stop_group(pgid, grace=1.0)


def _ballast_main(gpu: int, free_gib: float, ready: str) -> None:
    import torch

    torch.cuda.set_device(gpu)
    target = int(free_gib * GiB)
    held = []
    while True:
        free, _ = torch.cuda.mem_get_info(gpu)
        excess = free - target
        if excess < 64 * 2**20:
            break
        chunk = min(excess, 8 * GiB) if excess > GiB else excess - 16 * 2**20
        held.append(torch.empty(max(chunk, 1), dtype=torch.uint8, device=f"cuda:{gpu}"))
    free, total = torch.cuda.mem_get_info(gpu)
    Path(ready).write_text(f"{free} {total}\n")
    print(f"ballast on GPU {gpu}: {free / GiB:.2f} GiB free of {total / GiB:.2f}", flush=True)
    while True:
        time.sleep(3600)


# --- vllm.LLM in a fresh process -----------------------------------------------------------------


def _llm_child(engine_kwargs: dict, job, log: str, result: str, env: dict) -> None:
    os.setsid()  # vLLM's engine and workers join this group; stop_group ends them all
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.pop("VLLM_TARGET_DEVICE", None)
    for key, value in kernel_env().items():
        os.environ.setdefault(key, value)
    os.environ.update(with_torch_topk(env))  # the engine's and workers' processes start after this
    torch_topk_here()  # and what vLLM forks from this process (stock PP=1's EngineCore) inherits the hook
    t0 = time.time()
    res: dict = {}
    try:
        llm = None
        if engine_kwargs is not None:
            from vllm import LLM

            llm = LLM(**engine_kwargs)
            res["boot_s"] = round(time.time() - t0, 1)
        res.update(job(llm) if job is not None else {})
    except Exception as exc:
        import traceback

        traceback.print_exc()
        res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    res["total_s"] = round(time.time() - t0, 1)
    Path(result + ".tmp").write_text(json.dumps(res, default=str))
    os.replace(result + ".tmp", result)
    sys.stdout.flush()
    os._exit(0)  # no engine shutdown: the parent ends the whole group


def run_llm(engine_kwargs: dict | None, job=None, *, log: Path, timeout: float, env: dict | None = None) -> dict:
    """``vllm.LLM(**engine_kwargs)`` in a fresh (spawned) process leading its own group; then
    ``job(llm) -> dict`` there (a module-level function; ``engine_kwargs=None``: ``job(None)``
    without an engine). Returns its dict plus ``boot_s``, or
    ``error`` (what LLM or the job raised), ``timed_out``, ``wall_s`` and ``log``."""
    engine_kwargs = with_virtual_pair_attention(engine_kwargs, env)
    result = log.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    p = multiprocessing.get_context("spawn").Process(target=_llm_child,
                                                      args=(engine_kwargs, job, str(log), str(result), env))
    t0 = time.time()
    p.start()
    RUNNING.add(p.pid)
    try:
        while time.time() - t0 < timeout and p.is_alive() and not result.exists():
            time.sleep(0.25)
        timed_out = not result.exists() and p.is_alive()
    finally:
        stop_group(p.pid, grace=3.0, dump=not result.exists() and p.is_alive())
        p.join(timeout=5)
    res = json.loads(result.read_text()) if result.exists() else {"error": "no result"}
    return {**res, "timed_out": timed_out, "wall_s": round(time.time() - t0, 1), "log": log}


def assert_ran(res: dict) -> None:
    assert not res["timed_out"], f"vLLM did not finish within the limit:\n{tail(res['log'])}"
    assert "error" not in res, f"{res['error']}\n{tail(res['log'])}"


# --- vllm serve ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve MODEL ARGS`` in its own process group; ready once /health answers 200; the
    group is ended on exit (after vLLM's RemoteOpenAIServer)."""

    def __init__(self, model: str, args: list[str], *, log: Path, env: dict | None = None, timeout: float = 300):
        self.model, self.log, self.port = model, log, free_port()
        backend = virtual_pair_attention(env, _flag(args, "--attention-backend"), _flag(args, "--kv-cache-dtype"))
        if backend and not _flag(args, "--attention-backend"):
            args = [*args, "--attention-backend", backend]
            if not _flag(args, "--mm-encoder-attn-backend"):
                args = [*args, "--mm-encoder-attn-backend", VIRTUAL_PAIR_ENCODER_ATTENTION]
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *args,
                    "--port", str(self.port)]
        self.env, self.timeout = env, timeout

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> VllmServer:
        t0 = time.time()
        self.proc = start_group(self.cmd, self.log, self.env)
        try:
            while True:
                assert self.proc.poll() is None, f"vllm serve exited ({self.proc.returncode}):\n{tail(self.log)}"
                assert time.time() - t0 < self.timeout, f"vllm serve not healthy in {self.timeout:.0f} s:\n{tail(self.log)}"
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                        if r.status == 200:
                            break
                time.sleep(1.0)
        except BaseException:
            stop_group(self.proc.pid, dump=self.proc.poll() is None)
            raise
        self.ready_s = round(time.time() - t0, 1)
        return self

    def __exit__(self, *exc) -> None:
        # left by an error or an interrupt (a request that hung): its processes' stacks first
        stop_group(self.proc.pid, dump=exc[0] is not None)

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(self.url(path), json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, prompts: list[str], max_tokens: int = 16) -> list[str]:
        """Greedy completions, in prompt order."""
        resp = self.post("/v1/completions", {"model": self.model, "prompt": prompts, "max_tokens": max_tokens,
                                             "temperature": 0})
        return [c["text"] for c in sorted(resp["choices"], key=lambda c: c["index"])]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def gpu_out(request, tmp_path) -> Path:
    """This test's folder for logs: under $DUALGPU_GPU_OUT (the launcher collects it) or tmp_path."""
    root = os.environ.get("DUALGPU_GPU_OUT")
    if not root:
        return tmp_path
    d = Path(root) / re.sub(r"[^\w.-]+", "_", request.node.nodeid)
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(preset, weights="dummy") -> a folder written once per session (gpu_models)."""
    import gpu_models

    made: dict = {}

    def get(preset: str, weights: str = "dummy") -> Path:
        key = (preset, weights)
        if key not in made:
            made[key] = gpu_models.write_model(preset, tmp_path_factory.mktemp(f"{preset}-{weights}"), weights)
        return made[key]

    return get


if __name__ == "__main__" and sys.argv[1:2] == ["ballast"]:
    _ballast_main(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
