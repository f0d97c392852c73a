"""Patches of ``vllm.envs``: vLLM's check of VLLM_* variables should know this package's."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

PREFIX = "VLLM_DUALGPU_"


def wrap_validate_environ(original: Callable) -> Callable:
    """Hide VLLM_DUALGPU_* variables from vLLM's unknown-variable check, and only those."""

    @functools.wraps(original)
    def validate_environ(hard_fail):
        ours = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
        if not ours:
            return original(hard_fail)
        for k in ours:
            del os.environ[k]
        try:
            return original(hard_fail)
        finally:
            os.environ.update(ours)

    return validate_environ
