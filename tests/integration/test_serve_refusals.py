"""The plugin's own refusals at serve time: one ERROR line first, no traceback by default.

Through ``vllm serve`` in a subprocess on the CPU platform (a tiny Qwen3 config, dummy weights,
no network), and in-process as ``LLM(...)`` users meet them: as an exception to catch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def serve(model_dir, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--load-format", "dummy", "--skip-tokenizer-init", "--port", "18137", *args]
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    full_env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", **(env or {})})
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                       timeout=timeout, start_new_session=True)
    return p.returncode, p.stdout


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if " ERROR " in line]


@pytest.mark.slow
@pytest.mark.parametrize("args,first", [
    (["-pp", "2", "--distributed-executor-backend", "dualgpu"],
     "the dualgpu executor needs NVIDIA GPUs, but vLLM runs on its 'cpu' platform here. Use "
     "--distributed-executor-backend mp"),
])
def test_refusal_is_one_error_line_without_traceback(tiny_model_dir, args, first):
    rc, out = serve(tiny_model_dir, *args)
    assert rc != 0, out[-3000:]
    errors = _errors(out)
    assert len(errors) == 1 and first in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1] == errors[0]  # last word too: nothing after it
    assert "EngineCore" not in out  # refused in the front end: no engine process started


@pytest.mark.slow
def test_debug_logging_keeps_the_traceback(tiny_model_dir):
    rc, out = serve(tiny_model_dir, "-pp", "2", "--distributed-executor-backend", "dualgpu",
                    env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert rc != 0
    assert "the dualgpu executor needs NVIDIA GPUs" in _errors(out)[0]
    assert "Traceback" in out and "PreflightError" in out


def test_llm_users_get_an_exception(tiny_model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_dualgpu.engine.preflight import PreflightError

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # refuse() installs one; restore it
    args = EngineArgs(model=str(tiny_model_dir), load_format="dummy", skip_tokenizer_init=True,
                      pipeline_parallel_size=2, distributed_executor_backend="dualgpu")
    with pytest.raises(PreflightError, match="needs NVIDIA GPUs"):
        args.create_engine_config(UsageContext.LLM_CLASS)
    # a config built on its own (no engine to start) is not refused: tests and tools inspect it
    args = EngineArgs(model=str(tiny_model_dir), load_format="dummy", skip_tokenizer_init=True,
                      pipeline_parallel_size=2, distributed_executor_backend="dualgpu")
    assert args.create_engine_config().parallel_config.pipeline_parallel_size == 2


def test_refuse_hook_passes_other_exceptions_on(monkeypatch):
    from vllm_dualgpu.engine import preflight

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[1]))
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    ours = preflight.PreflightError("x")
    preflight.refuse(ours)
    sys.excepthook(type(ours), ours, None)
    preflight.refuse(ours)
    wrapped = RuntimeError("engine failed")
    wrapped.__cause__ = ours
    sys.excepthook(RuntimeError, wrapped, None)
    preflight.refuse(ours)
    other = KeyError("k")
    sys.excepthook(KeyError, other, None)
    assert seen == [other]


def test_refuse_leaves_no_hook_behind(monkeypatch):
    """The hook is installed once however many refusals there are, and it is gone after its
    first use: the process's excepthook is the one it had before."""
    from vllm_dualgpu.engine import preflight

    seen = []

    def before(*a):
        seen.append(a[1])

    monkeypatch.setattr(sys, "excepthook", before)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    first, second = preflight.PreflightError("a"), preflight.PreflightError("b")
    preflight.refuse(first)
    preflight.refuse(second)  # e.g. an LLM(...) caller caught the first and tried again
    sys.excepthook(type(second), second, None)  # the uncaught one: nothing more printed
    assert seen == [] and sys.excepthook is before
    other = KeyError("k")
    sys.excepthook(KeyError, other, None)
    assert seen == [other]
