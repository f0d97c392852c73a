"""Patches of vLLM's unknown-variable check: it should know this package's VLLM_DUALGPU_*.

vLLM 0.30 checks in ``vllm.envs.validate_environ(hard_fail)``; from 0.31 the same loop is the
classmethod ``Platform.validate_environ(cls, hard_fail)`` (``platforms/interface.py``), called
as ``current_platform.validate_environ(...)`` from ``EngineArgs.create_engine_config``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

PREFIX = "VLLM_DUALGPU_"


@contextlib.contextmanager
def _ours_hidden():
    """This package's variables out of os.environ for the duration, every other one kept."""
    ours = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    for k in ours:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(ours)


def wrap_validate_environ(original: Callable) -> Callable:
    """vLLM 0.30's module function: hide VLLM_DUALGPU_* from the check, and only those."""

    @functools.wraps(original)
    def validate_environ(hard_fail):
        with _ours_hidden():
            return original(hard_fail)

    return validate_environ


def wrap_platform_validate_environ(original: Callable) -> Callable:
    """vLLM 0.31+'s classmethod (the function under it, taking the class first)."""

    @functools.wraps(original)
    def validate_environ(cls, hard_fail):
        with _ours_hidden():
            return original(cls, hard_fail)

    return validate_environ
