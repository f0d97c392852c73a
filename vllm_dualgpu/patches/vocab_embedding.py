"""Patch of ``VocabParallelEmbedding.__init__``: the Qwen3-Next/Qwen3.5 family's token embeddings
get the model's quantization config, as Qwen2 and Llama give theirs.

vLLM 0.30 builds ``embed_tokens`` without ``quant_config`` in four places
(``Qwen3NextModel.__init__``, ``qwen3_next.py:650``; ``Qwen3_5Model.__init__``,
``qwen3_5.py:245``; ``Qwen3NextMultiTokenPredictor.__init__``, ``qwen3_next_mtp.py:65``;
``Qwen3_5MultiTokenPredictor.__init__``, ``qwen3_5_mtp.py:85``). A checkpoint whose embedding is
quantized (compressed-tensors W8A16/W4A16 INT, which vLLM loads with
``CompressedTensorsEmbeddingWNA16Int``) then gets a dense bf16 table and fails to load
(``embed_tokens.weight_packed`` has no parameter to go to), or must be served with the table
dequantized: 2.4 GiB for the 27B reference model, on the first PP rank, the small card.

Those ``__init__`` methods belong to ``@support_torch_compile`` classes, whose decorator keeps the
original in a closure, so the call itself is patched: when one of those four methods (recognised
by its code object's qualified name and file) builds an embedding without ``quant_config``, the
patched ``__init__`` adds ``vllm_config.quant_config`` and the prefix ``<prefix>.embed_tokens``
from that method's own arguments (what vLLM PR #45994 passes). Every other caller, every call
that passes ``quant_config`` (so the patch falls silent once vLLM passes it), and runs of other
executors keep vLLM's behaviour. A quantization config without an embedding method returns
``None`` for the layer and vLLM keeps its unquantized table, as for Qwen2 and Llama.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from vllm_dualgpu import rank_summary
from vllm_dualgpu.patches.spec_common import is_dualgpu_run

# Module of the caller -> qualified name of the method that builds embed_tokens without
# quant_config in vLLM 0.30.
CALLERS: dict[str, str] = {
    "vllm.model_executor.models.qwen3_next": "Qwen3NextModel.__init__",
    "vllm.model_executor.models.qwen3_5": "Qwen3_5Model.__init__",
    "vllm.model_executor.models.qwen3_next_mtp": "Qwen3NextMultiTokenPredictor.__init__",
    "vllm.model_executor.models.qwen3_5_mtp": "Qwen3_5MultiTokenPredictor.__init__",
}
SUMMARY_KEY = "embeddings with the model's quant_config"
# Positional parameters after self: num_embeddings, embedding_dim, params_dtype,
# org_num_embeddings, padding_size, then quant_config and prefix.
QUANT_CONFIG_INDEX = 5


def _is_known_caller(code) -> bool:
    for module_name, qualname in CALLERS.items():
        module = sys.modules.get(module_name)
        if module is None or getattr(code, "co_qualname", None) != qualname:
            continue
        if code.co_filename == getattr(module, "__file__", None):
            return True
    return False


def caller_quantization(frame) -> tuple[object, str] | None:
    """(quant_config, prefix) for an embedding built by one of CALLERS in ``frame``, else None."""
    if frame is None or not _is_known_caller(frame.f_code):
        return None
    local = frame.f_locals
    quant_config = getattr(local.get("vllm_config"), "quant_config", None)
    if quant_config is None:
        return None
    prefix = local.get("prefix") or ""
    return quant_config, f"{prefix}.embed_tokens" if prefix else "embed_tokens"


def wrap_vocab_parallel_embedding_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        found = None
        if (
            len(args) <= QUANT_CONFIG_INDEX  # neither quant_config nor prefix given by position
            and "quant_config" not in kwargs
            and kwargs.get("quant_method") is None  # a caller's own method is kept
            and is_dualgpu_run()
        ):
            found = caller_quantization(sys._getframe(1))
        if found is not None:
            kwargs["quant_config"] = found[0]
            kwargs.setdefault("prefix", found[1])
        original(self, *args, **kwargs)
        if found is not None:  # this rank's summary line names each completed embedding
            rank_summary.add(SUMMARY_KEY, f"{kwargs['prefix']} {type(self.quant_method).__name__}")

    return __init__
