"""NVLink detection through NVML: it picks the planner's NCCL-buffer term for the pipeline."""

from __future__ import annotations

import pynvml
import pytest

from vllm_dualgpu.nvml import _has_nvlink


class _Nvml:
    """pynvml's names, with nvmlDeviceGetNvLinkState answering from a table."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, states):
        self.states = states

    def nvmlDeviceGetNvLinkState(self, handle, link):
        state = self.states[link]
        if isinstance(state, int) and not isinstance(state, bool):
            raise pynvml.NVMLError(state)
        if isinstance(state, Exception):
            raise state
        return state


@pytest.mark.parametrize(
    "states, expected",
    [
        ([False, True, False, False], True),  # one active link (an NVLink H200)
        ([False] * 4, False),  # links exist, none active
        ([pynvml.NVML_ERROR_NOT_SUPPORTED] * 4, False),  # a GeForce card: no NVLink at all
        ([pynvml.NVML_ERROR_UNKNOWN] * 4, None),  # NVML cannot say: the planner assumes PCIe
        ([False, pynvml.NVML_ERROR_INVALID_ARGUMENT, True, True], False),  # past the last link
        ([RuntimeError("driver gone")] * 4, None),
    ],
)
def test_nvlink_state(states, expected):
    assert _has_nvlink(_Nvml(states), handle=object()) is expected
