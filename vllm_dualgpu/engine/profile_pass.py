"""vLLM's profile pass once before the one it measures.

On a first boot the profile pass is also where torch.compile builds the graphs and Triton
autotunes its kernels; autotuning benchmarks each configuration with buffers of its own. vLLM
charges that pass's peak to every later step, so a first boot left the KV cache less than a
later boot of the same command. Measured on the virtual pair (vLLM 0.33, W8A16 + DFlash2, 19/45):
rank 1's pass peaked at 24.19 GiB of torch memory on the first boot and 21.95 GiB on the next;
the first boot's plugin arm was refused a context the plan holds. After one unmeasured pass the
measured one sees what serving does: compiled graphs, tuned kernels.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch

GiB = 1024**3


def first_profile_pass(worker) -> str:
    """Run the model runner's profile pass once, unmeasured, under vLLM's allocator split limit
    (vLLM 0.33's ``_scoped_allocator_max_split``, where present), then give torch's wholly free
    segments back. Returns a note for the rank's log ("" when the runner has no profile pass)."""
    runner = getattr(worker, "model_runner", None)
    run = getattr(runner, "profile_run", None)
    if run is None:
        return ""
    kwargs = {}
    with contextlib.suppress(TypeError, ValueError):
        if "randomize_inputs" in inspect.signature(run).parameters:
            kwargs["randomize_inputs"] = getattr(worker, "randomize_dummy_inputs", False)
    started = time.perf_counter()
    with split_limited(worker), _current_config(getattr(worker, "vllm_config", None)):
        run(**kwargs)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(worker.device) if torch.cuda.is_available() else 0
    return (f"a first profile pass before vLLM's measured one ({seconds:.1f} s, torch's peak "
            f"{peak / GiB:.2f} GiB: a first boot compiles and autotunes there)")


@contextlib.contextmanager
def split_limited(worker):
    """Run a profile pass under vLLM's allocator split limit (vLLM 0.33's
    ``_scoped_allocator_max_split``, 20 MiB: the smallest PyTorch allows, the one vLLM uses for its
    measured profile), then give torch's wholly free segments back to the card (``empty_cache``).

    Without the limit, small blocks carved out of multi-GiB blocks freed during the pass pin those
    segments: a rank held to its card then failed to allocate its KV cache with GiBs "reserved by
    PyTorch but unallocated". Yields a note for the log: "" on a vLLM without the limit."""
    scoped = getattr(worker, "_scoped_allocator_max_split", None)
    try:
        if scoped is None:
            yield ""
        else:
            with scoped(max_split_size_mb=20):
                yield ", profile pass under the allocator split limit (max_split_size_mb 20)"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _current_config(vllm_config):
    if vllm_config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)
