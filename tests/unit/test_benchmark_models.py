"""benchmarks/soak.py and benchmarks/memory_sweep.py keep their model folders under --models, not
under the output dir: one path per content, so a run into another output dir reuses vLLM's
compile cache (keyed by the model's path; see tests/unit/test_headline_models.py)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_sweep as ms  # noqa: E402
import soak  # noqa: E402
from gpu_models import has_mtp  # noqa: E402


def test_soak_serves_one_model_path_from_two_output_dirs(tmp_path, monkeypatch):
    served = []

    class NoServer:  # records the model it was given, then fails its health check
        def __init__(self, model, *a, **k):
            served.append(model)

        def __enter__(self):
            raise AssertionError("not healthy (stand-in)")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(soak, "VllmServer", NoServer)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's handlers would end the test process
    models = tmp_path / "models"
    for out in (tmp_path / "run1", tmp_path / "run2"):
        assert soak.main([str(out), "--models", str(models), "--gpu-memory-utilization", "0.5"]) == 1
        assert json.loads((out / "soak.json").read_text())["ready"] is False
        assert not (out / "models").exists()
    assert len(served) == 2 and served[0] == served[1]
    model = Path(served[0])
    assert model.parent == models and has_mtp(model)  # the preset's random weights, MTP's included
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen3_5_text"


def test_soak_models_default_to_the_shared_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert soak.parse_args(["out"]).models == tmp_path / "xdg" / "vllm-dualgpu" / "headline-models"
    assert soak.parse_args(["out", "--models", "m"]).models == Path("m")


def test_memory_sweep_runs_one_model_path_from_two_output_dirs(tmp_path, monkeypatch):
    ran = []

    def run_one(name, kwargs, out, **kw):
        ran.append(kwargs["model"])
        return {"name": name, "kv_tokens": None, "booted": False, "peak_used_gib": [], "plan": {"partition": [12, 28]}}

    monkeypatch.setattr(ms, "run_one", run_one)
    monkeypatch.setattr(ms, "ballast", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(ms, "on_signals_stop_all", lambda: None)
    monkeypatch.setattr(ms, "plot", lambda *a: None)
    models = tmp_path / "models"
    for out in (tmp_path / "run1", tmp_path / "run2"):
        monkeypatch.setattr(sys, "argv", ["memory_sweep.py", str(out), "--skip", "stock,sweep,full-context",
                                          "--models", str(models)])
        assert ms.main() == 0
        assert not (out / "models").exists()
    assert len(ran) == 2 and ran[0] == ran[1]
    model = Path(ran[0])
    assert model.parent == models
    assert json.loads((model / "config.json").read_text())["hidden_size"] == 5120  # the Qwen3-14B-class preset


def test_memory_sweep_models_default_to_the_shared_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ms.build_parser().parse_args(["out"]).models == tmp_path / "xdg" / "vllm-dualgpu" / "headline-models"
