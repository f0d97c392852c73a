"""The package imports nothing heavy, and vLLM finds and runs its entry point."""

from __future__ import annotations

import re

import importlib.metadata
import subprocess
import sys
import textwrap


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env},
        timeout=300,
    )


def test_import_pulls_in_no_vllm_or_torch():
    r = run_py(
        """
        import sys
        import vllm_dualgpu
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'pynvml'))
        print(repr(heavy))
        print(vllm_dualgpu.__version__)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "[]"


def test_entry_point_is_declared_and_loads():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "dualgpu"]
    assert len(ours) == 1
    assert ours[0].value == "vllm_dualgpu:register"
    import vllm_dualgpu

    assert ours[0].load() is vllm_dualgpu.register


def test_vllm_loads_plugin_once_and_it_logs_one_line():
    """vLLM's own loader runs register(); calling it again changes nothing and logs nothing."""
    r = run_py(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm_dualgpu
        vllm_dualgpu.register()
        vllm_dualgpu.register()
        from vllm.engine.arg_utils import EngineArgs
        from vllm_dualgpu.patching.core import SENTINEL
        f = EngineArgs.create_engine_config
        print("SENTINEL", getattr(f, SENTINEL, None), getattr(f.__wrapped__, SENTINEL, None))
        """
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    lines = [l for l in out.splitlines() if "vllm-dualgpu 0.1.0 (" in l]
    assert len(lines) == 1, out
    # vLLM's format: "INFO ..." (0.30), "(MainProcess pid=N) INFO ..." (0.33).
    assert re.match(r"(\(\w+ pid=\d+\) )?INFO ", lines[0]) and "applied executor-by-name" in lines[0]
    assert "[plugin.py:" in lines[0]  # vLLM's logger format: [file:line]
    # Applied once: the wrapper wraps the original, not another wrapper.
    assert "SENTINEL executor-by-name None" in out


def test_plugin_disabled_through_vllm_plugins():
    r = run_py(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.engine.arg_utils import EngineArgs
        print("PATCHED", hasattr(EngineArgs.create_engine_config, "__vllm_dualgpu_patch__"))
        """,
        VLLM_PLUGINS="",
    )
    assert r.returncode == 0, r.stderr
    assert "PATCHED False" in r.stdout
    assert "vllm-dualgpu 0.1.0 (" not in r.stdout + r.stderr
