"""engine/no_gpu.py: which command lines ask for the dualgpu backend, what NVML says when it sees
no GPU, and the refusal that names ``vllm-dualgpu doctor`` (NVML and vLLM's platform faked)."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_dualgpu.engine import no_gpu
from vllm_dualgpu.engine.preflight import PreflightError


@pytest.mark.parametrize("argv,asks", [
    (["serve", "M", "-pp", "2", "--distributed-executor-backend", "dualgpu"], True),
    (["serve", "M", "--distributed-executor-backend=dualgpu"], True),
    (["serve", "M", "--distributed_executor_backend", "dualgpu"], True),
    (["serve", "M", "--distributed-executor-backend", "dualgpu-ray"], False),
    (["serve", "M", "--distributed-executor-backend", "mp"], False),
    (["serve", "dualgpu"], False),
    (["serve", "M", "--distributed-executor-backend"], False),
])
def test_which_command_lines_ask_for_dualgpu(argv, asks):
    assert no_gpu.asks_for_dualgpu(argv) is asks


def fake_nvml(monkeypatch, *, count=2, init_error=None):
    class NVMLError(Exception):
        pass

    m = types.ModuleType("pynvml")
    calls = []

    def init():
        if init_error:
            raise NVMLError(init_error)
        calls.append("init")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: count
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return calls


def test_no_driver(monkeypatch):
    fake_nvml(monkeypatch, init_error="NVML Shared Library Not Found")
    assert no_gpu.nvml_sees_no_gpu() == (
        "NVML does not start (NVML Shared Library Not Found): is the NVIDIA driver installed?")


def test_no_nvml_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert "nvidia-ml-py" in no_gpu.nvml_sees_no_gpu()


def test_no_card_and_cards_hidden(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    calls = fake_nvml(monkeypatch, count=0)
    assert no_gpu.nvml_sees_no_gpu() == "NVML lists no GPU"
    assert calls == ["init", "shutdown"]
    fake_nvml(monkeypatch, count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert no_gpu.nvml_sees_no_gpu() == "CUDA_VISIBLE_DEVICES='-1' hides all 2"


def test_two_cards_seen(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_nvml(monkeypatch, count=2)
    assert no_gpu.nvml_sees_no_gpu() is None


def test_refusal_names_doctor_and_hides_the_traceback(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # refuse() installs one; restore it
    monkeypatch.setattr(no_gpu, "_vllm_found_no_device", lambda: True)
    fake_nvml(monkeypatch, init_error="Driver Not Loaded")
    with pytest.raises(PreflightError) as e:
        no_gpu.check_command_line(["serve", "M", "--distributed-executor-backend", "dualgpu"])
    assert str(e.value).startswith("vllm-dualgpu: no NVIDIA GPU here")
    assert "Driver Not Loaded" in str(e.value) and "`vllm-dualgpu doctor`" in str(e.value)
    with pytest.raises(PreflightError):
        no_gpu.check_backend("dualgpu")
    no_gpu.check_command_line(["serve", "M", "--distributed-executor-backend", "mp"])  # not ours
    no_gpu.check_backend("mp")


def test_no_refusal_where_vllm_found_a_device_or_nvml_sees_a_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(no_gpu, "_vllm_found_no_device", lambda: False)
    fake_nvml(monkeypatch, count=0)
    no_gpu.check_backend("dualgpu")  # the CPU platform: the executor's platform check says it
    monkeypatch.setattr(no_gpu, "_vllm_found_no_device", lambda: True)
    fake_nvml(monkeypatch, count=1)
    no_gpu.check_backend("dualgpu")  # vLLM's own error is the right one then
