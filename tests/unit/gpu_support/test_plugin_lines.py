"""The CPU part of gpu_harness's plugin-line checks: a spawned worker logs the plugin's summary
twice (when it loads the plugin, "nothing applied yet"; once the dualgpu worker has applied its
patches, the list), so a patch counts as applied when each process's last summary lists it, and
``at_least`` counts processes, not lines. The lines are vLLM 0.33.0's, from a virtual-pair run."""

from __future__ import annotations

import pytest

from gpu_harness import assert_applied, plugin_lines

FRONTEND = ("(APIServer pid=100) INFO 12-03 03:49:43 [plugin.py:211] vllm-dualgpu 0.1.0 (frontend, pid 100, "
            "vLLM 0.33.0): applied executor-by-name, executor-help; skipped none")
LOADED = ("(VllmWorker-{w} pid={pid}) INFO 12-03 03:50:29 [plugin.py:198] vllm-dualgpu 0.1.0 (worker, pid {pid}, "
          "vLLM 0.33.0): nothing applied yet; the dualgpu worker applies the worker patches when it starts "
          "(none under other executors)")
APPLIED = ("(VllmWorker-{w} pid={pid}) INFO 12-03 03:50:32 [plugin.py:211] vllm-dualgpu 0.1.0 (worker, pid {pid}, "
           "vLLM 0.33.0): applied capability-per-rank, {names}; skipped none")


def write(tmp_path, *lines: str):
    log = tmp_path / "dualgpu.log"
    log.write_text("\n".join((FRONTEND, *lines)) + "\n")
    return log


def spawned(w: int, pid: int, names: str = "vision-tower-first-rank-only, pp-inflight-batches") -> list[str]:
    return [LOADED.format(w=w, pid=pid), APPLIED.format(w=w, pid=pid, names=names)]


def test_each_spawned_workers_last_summary_counts(tmp_path):
    log = write(tmp_path, *spawned(1, 9413), *spawned(0, 9412))
    assert len(plugin_lines(log, "worker")) == 4
    assert_applied(log, "worker", ("vision-tower-first-rank-only",), at_least=2)


def test_a_worker_that_never_applied_is_named(tmp_path):
    log = write(tmp_path, *spawned(0, 9412), LOADED.format(w=1, pid=9413))
    with pytest.raises(AssertionError, match=r"pid 9413.*nothing applied yet"):
        assert_applied(log, "worker", ("vision-tower-first-rank-only",), at_least=2)


def test_a_worker_whose_list_lacks_the_patch_fails(tmp_path):
    log = write(tmp_path, *spawned(0, 9412), *spawned(1, 9413, names="pp-inflight-batches"))
    with pytest.raises(AssertionError, match=r"did not apply \['vision-tower-first-rank-only'\].*pid 9413"):
        assert_applied(log, "worker", ("vision-tower-first-rank-only",), at_least=2)


def test_two_lines_of_one_worker_are_one_process(tmp_path):
    log = write(tmp_path, *spawned(0, 9412))
    with pytest.raises(AssertionError, match="1 worker process"):
        assert_applied(log, "worker", ("vision-tower-first-rank-only",), at_least=2)


def test_a_later_summary_does_not_hide_an_earlier_one_of_another_process(tmp_path):
    log = write(tmp_path, *spawned(0, 9412, names="pp-inflight-batches"), *spawned(1, 9413))
    with pytest.raises(AssertionError, match="pid 9412"):
        assert_applied(log, "worker", ("vision-tower-first-rank-only",), at_least=2)
