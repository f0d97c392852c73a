"""The CPU part of the fault tests' log reading: the lines that name a dead or unanswering rank,
told apart from the other plugin lines that start with "vllm-dualgpu: ... rank". The lines are
vLLM 0.33.0's from the virtual-pair fault runs of 2026-12-03; on that SIGKILL run the harness's
old pattern also took the reserve line ("rank 0 on GPU 0 ... kept free") as a naming line."""

from __future__ import annotations

from gpu_harness import rank_fault_lines

P = "(EngineCore pid=3375) INFO 12-03 06:39:11 [rank_faults.py:40] "
RESERVE = (P + "vllm-dualgpu: rank 0 on GPU 0 (NVIDIA GeForce RTX 4070 Ti SUPER): 0.25 GiB kept free (no display "
           "on this card); rank 1 on GPU 0 (NVIDIA H200): 0.25 GiB kept free (no display on this card)")
KILLED = (P + "vllm-dualgpu: pipeline rank 1 (GPU 0: NVIDIA H200) was killed by signal 9 (SIGKILL: out of host "
          "memory, or killed from outside); the engine shuts down and fails its requests")
EXITED = P + "vllm-dualgpu: pipeline rank 0 (GPU 0: RTX 5090) exited with status 1; the engine shuts down and fails its requests"
TP_KILLED = (P + "vllm-dualgpu: rank 3 (stage 1, TP rank 1) (GPU 0: NVIDIA H200) was killed by signal 9 (SIGKILL: "
             "out of host memory, or killed from outside); the engine shuts down and fails its requests")
UNANSWERED = (P + "vllm-dualgpu: no answer to sample_tokens within 30 s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS): "
              "pipeline rank 1 (GPU 0: NVIDIA H200) is stopped (SIGSTOP or a debugger; SIGCONT resumes it); "
              "pipeline rank 0 (GPU 0: NVIDIA GeForce RTX 4070 Ti SUPER) is running or waiting for another rank. "
              "The engine fails its requests; if a step legitimately takes longer (a first compile, a long "
              "prefill), raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
OTHERS = [
    ("(Worker_PP0 pid=3508) INFO 12-03 06:36:40 [context_fit.py:77] vllm-dualgpu rank 0: vLLM's profile leaves "
     "4.63 GiB for the KV cache, the plan 4.61 GiB"),
    ("(Worker_PP1 pid=3509) INFO 12-03 06:36:40 [worker.py:120] vllm-dualgpu rank 1/2: patched once the device was "
     "set: qwen3-next-aux-hidden-states"),
    ("(EngineCore pid=3375) INFO 12-03 06:35:50 [plan.py:60] vllm-dualgpu plan: ranks 0:NVIDIA GeForce RTX 4070 Ti "
     "SUPER (16.0/16.0 GiB free)"),
]


def write(tmp_path, *lines):
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    return log


def test_the_reserve_line_names_no_rank(tmp_path):
    found = rank_fault_lines(write(tmp_path, RESERVE, *OTHERS, KILLED))
    assert found == {"dead": [KILLED.split("] ", 1)[1]], "unanswered": []}


def test_dead_ranks_by_signal_or_status_with_and_without_tp_stages(tmp_path):
    found = rank_fault_lines(write(tmp_path, EXITED, RESERVE, TP_KILLED))
    assert [line[:44] for line in found["dead"]] == ["vllm-dualgpu: pipeline rank 0 (GPU 0: RTX 50",
                                                    "vllm-dualgpu: rank 3 (stage 1, TP rank 1) (G"]
    assert found["unanswered"] == []


def test_an_unanswered_step_is_its_own_kind(tmp_path):
    found = rank_fault_lines(write(tmp_path, RESERVE, *OTHERS, UNANSWERED))
    assert found["dead"] == []
    assert found["unanswered"] == [UNANSWERED.split("] ", 1)[1]]


def test_a_log_without_faults(tmp_path):
    assert rank_fault_lines(write(tmp_path, RESERVE, *OTHERS)) == {"dead": [], "unanswered": []}
    assert rank_fault_lines(tmp_path / "missing.log") == {"dead": [], "unanswered": []}
