"""Speculative decoding under PP (issue #6): each patch on real vLLM objects, stock vs patched.

Every test shows the stock behaviour (vLLM's original, reached through ``__wrapped__`` or by
reverting the patch) and the patched one, so each fails without its patch.
"""


from __future__ import annotations
import functools
import pickle
import shutil
import sys
import types
import pytest
import torch
from torch import nn
from conftest import apply_registry_patch, registry_patch
from vllm_dualgpu.patching.core import ALREADY, APPLIED, SENTINEL, Patch, apply_patch, revert_patch
from pathlib import Path


def test_property_getter_is_wrapped_and_reverted(monkeypatch):
    mod = types.ModuleType("fake_prop_target")
    exec(
        "class C:\n"
        "    def __init__(self):\n        self._v = 3\n"
        "    @property\n    def v(self):\n        '''doc'''\n        return self._v\n"
        "    @v.setter\n    def v(self, value):\n        self._v = value\n",
        mod.__dict__,
    )
    factories = types.ModuleType("fake_prop_factories")

    def plus_ten(original):
        @functools.wraps(original)
        def getter(self):
            return original(self) + 10

        return getter

    factories.plus_ten = plus_ten
    monkeypatch.setitem(sys.modules, "fake_prop_target", mod)
    monkeypatch.setitem(sys.modules, "fake_prop_factories", factories)
    p = Patch(
        name="prop",
        target="fake_prop_target:C.v",
        processes=("engine",),
        vllm_versions=">=0.30.0,<0.31",
        why="w",
        upstream="u",
        remove_when="r",
        factory="fake_prop_factories:plus_ten",
        params=("self",),
    )
    obj = mod.C()
    assert apply_patch(p, "0.30.0").status == APPLIED
    raw = vars(mod.C)["v"]
    assert isinstance(raw, property) and raw.__doc__ == "doc"
    assert obj.v == 13
    obj.v = 5  # the setter survives
    assert obj.v == 15
    assert apply_patch(p, "0.30.0").status == ALREADY and obj.v == 15
    assert revert_patch(p) and isinstance(vars(mod.C)["v"], property) and obj.v == 5
