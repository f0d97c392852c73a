"""GPU test children only (``DUALGPU_GPU_TORCH_TOPK=1``, gpu_harness.torch_topk_env): vLLM's
vocab-parallel top-k uses torch.topk instead of FlashInfer's radix top-k.

vLLM 0.33's ``LogitsProcessor.get_top_k_tokens`` (called by a DFlash2 drafter's candidate
selector on its first step) takes FlashInfer's ``top_k`` wherever FlashInfer can build, and a GPU
machine without FlashInfer's precompiled kernels (``vllm download-kernels``) JIT-builds it first:
more than 22 minutes beside other tests (docs/gpu-runs.md, twenty-fourth session). The switch is
for both arms of a comparison alike. It hooks the import of
``vllm.model_executor.layers.logits_processor`` and replaces its module-level
``_flashinfer_topk`` (``_topk`` calls it as a global) by one that answers None, vLLM's own
answer where FlashInfer is absent; each process says on stderr whether it applied.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "vllm.model_executor.layers.logits_processor"
APPLIED = "gpu-harness: torch top-k instead of FlashInfer's in pid"
MISSING = "gpu-harness: torch top-k NOT applied: no _flashinfer_topk in"


def _torch_topk_instead():
    return None


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            if callable(getattr(module, "_flashinfer_topk", None)):
                module._flashinfer_topk = _torch_topk_instead
                print(f"{APPLIED} {os.getpid()}", file=sys.stderr, flush=True)
            else:
                print(f"{MISSING} {TARGET}", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
