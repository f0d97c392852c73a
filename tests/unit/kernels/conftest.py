"""The fake CUDA runtime shared by the sm hook tests (one per session: see sm_fakes.py)."""

from __future__ import annotations

import ctypes

import pytest
from sm_fakes import CUDART, build


@pytest.fixture(scope="session")
def fake_cudart(tmp_path_factory):
    """(path, ctypes handle) of libfakecudart.so."""
    d = tmp_path_factory.mktemp("fakecudart")
    path = build(d, "libfakecudart.so", CUDART)
    return path, ctypes.CDLL(str(path))
