"""The lines that name a pipeline rank when it stops working: dead (its process ended) or not
answering a step within vLLM's bound. Plain functions of vLLM's worker handles (``rank``,
``proc``) and the plan's GPUs; the dualgpu executor logs them."""

from __future__ import annotations

from pathlib import Path


def rank_label(rank: int, gpus=None, tp_size: int = 1) -> str:
    """"pipeline rank 1 (GPU 0: RTX 5090)"; with TP groups as stages also the stage and TP rank."""
    gpu = gpus[rank] if gpus and rank < len(gpus) else None
    where = f" (GPU {gpu.physical_id}: {gpu.name})" if gpu else ""
    who = (f"pipeline rank {rank}" if tp_size == 1
           else f"rank {rank} (stage {rank // tp_size}, TP rank {rank % tp_size})")
    return who + where


def dead_rank_lines(workers, gpus=None, tp_size: int = 1) -> list[str]:
    """One line per worker process that has ended: its rank (with TP stages also its stage and
    TP rank), GPU and exit status."""
    lines = []
    for h in workers:
        code = h.proc.exitcode
        if code is None:
            continue
        if code < 0:
            how = f"was killed by signal {-code}"
            if -code == 9:
                how += " (SIGKILL: out of host memory, or killed from outside)"
        else:
            how = f"exited with status {code}"
            if code == 1:
                how += (" (a rank that fails in warm-up or runs out of GPU memory while serving ends itself: "
                        "see its ERROR line above)")
        lines.append(f"vllm-dualgpu: {rank_label(h.rank, gpus, tp_size)} {how}; the engine shuts down "
                     "and fails its requests")
    return lines


def process_state(pid: int | None) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, t, Z, ...); None where it cannot be read."""
    if pid is None:
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


STATES = {"T": "is stopped (SIGSTOP or a debugger; SIGCONT resumes it)",
          "t": "is stopped by a debugger",
          "D": "is in an uninterruptible wait (the driver or I/O)",
          "Z": "has exited", "X": "has exited"}


# What vLLM 0.33's MultiprocExecutor bounds with VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (the steps).
STEP_METHODS = ("execute_model", "sample_tokens", "execute_dummy_batch", "take_draft_token_ids")


def method_name(method) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", "a call")


def unanswered_line(workers, gpus, tp_size: int, method, timeout) -> str:
    """Why a call to the workers ran past its bound, as far as their processes tell: the ranks
    that are stopped (or otherwise not running) first, then the others."""
    name = method_name(method)
    step = name in STEP_METHODS
    within = f"within {timeout:g} s" if timeout else "in time"
    if step:
        within += " (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)"
    odd, others = [], []
    for h in workers:
        proc = h.proc
        state = "Z" if getattr(proc, "exitcode", None) is not None else process_state(getattr(proc, "pid", None))
        label = rank_label(h.rank, gpus, tp_size)
        if state in STATES:
            odd.append(f"{label} {STATES[state]}")
        else:
            others.append(label)
    parts = odd + ([f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} running or waiting for "
                    "another rank"] if others else [])
    advice = ("The engine fails its requests; if a step legitimately takes longer (a first compile, a long "
              "prefill), raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS") if step else "vLLM raises TimeoutError"
    return f"vllm-dualgpu: no answer to {name} {within}: {'; '.join(parts)}. {advice}"
