"""interventions.probe_in_file: a vLLM method checked from its module's file, for a module that
does not import everywhere (vLLM 0.30's FlashInfer backend asserts CUDA at import: on a CPU-only
torch, CI's, importing it raised "Torch not compiled with CUDA enabled" where the file was as the
intervention expects)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from vllm_dualgpu.patching import interventions as I

MODULE = '''
raise AssertionError("Torch not compiled with CUDA enabled")  # what importing it does here


class Builder:
    def _get_workspace_buffer(self):
        size = envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE
        return max(size, self.max_num_batched_tokens * 16)
'''


@pytest.fixture
def item(tmp_path, monkeypatch):
    (tmp_path / "probe_target_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("probe_target_mod", None)
    return I.Intervention(name="x", kind=I.ENVIRONMENT, target="VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE",
                          processes=(I.ENGINE,), vllm_versions=I.CHECKED, why="", upstream="", remove_when="",
                          checks="probe_target_mod:Builder._get_workspace_buffer", params=("self",),
                          source_names=("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "max_num_batched_tokens"),
                          probe="vllm_dualgpu.patching.interventions:probe_in_file")


def test_a_module_that_cannot_import_is_read_from_its_file(item):
    with pytest.raises(AssertionError):
        __import__("probe_target_mod")
    assert I.check_intervention(item, "0.30.0").status == I.HOLDS


@pytest.mark.parametrize("change,why", [
    ({"params": ("self", "device")}, "takes (self), expected (self, device)"),
    ({"source_names": ("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "num_qo_heads")}, "no longer uses num_qo_heads"),
    ({"checks": "probe_target_mod:Builder.gone"}, "not found"),
])
def test_what_differs_is_missing_with_the_reason(item, change, why):
    f = I.check_intervention(dataclasses.replace(item, **change), "0.30.0")
    assert f.status == I.MISSING and why in f.reason, f.reason
