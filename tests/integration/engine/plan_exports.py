"""Shared by the engine tests (imported by name): the plan's exports are undone after each test."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def restore_environ():
    """apply_plan exports variables for the workers it is about to spawn (the split, the GPU
    order, Ray's bundle indices); undo that, and forget the exported split."""
    from vllm_dualgpu import envs

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    envs.forget_exports()
