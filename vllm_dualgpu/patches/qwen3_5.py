"""Patches of ``vllm.model_executor.models.qwen3_5``: text-only Qwen3.5 models set their auxiliary
layers through vLLM's mixin.

``Qwen3_5ForCausalLMBase.set_aux_hidden_state_layers`` (``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``) stores the layer tuple on its decoder directly, bypassing
``EagleModelMixin._set_aux_hidden_state_layers``, which every other EAGLE3 model reaches
(``Qwen3NextForCausalLM`` and the multimodal ``Qwen3_5ForConditionalGeneration`` through
``SupportsEagle3.set_aux_hidden_state_layers``). The mixin sorts and de-duplicates the layers
and computes the PP slot layout (``_aux_slot_base_cached``/``_aux_upstream_total_cached``) that
the relay needs. Under the dualgpu executor the patched method calls the mixin for a
Qwen3-Next/Qwen3.5 decoder; the captured states are the same (the forward tests membership, in
layer order), and the ``qwen3-next-aux-hidden-flag`` patch can then declare the relay. Other
decoders (a subclass with its own, such as InternS2 Mobius) and other executors keep vLLM's
code. The patch pins the source of vLLM's method.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from vllm_dualgpu.patches.models_interfaces import QWEN3_NEXT_MODULE
from vllm_dualgpu.patches.spec_common import is_dualgpu_run


def wrap_set_aux_hidden_state_layers(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_aux_hidden_state_layers(self, layers) -> None:
        qwen3_next = sys.modules.get(QWEN3_NEXT_MODULE)
        inner = getattr(self, "model", None)
        if (
            not is_dualgpu_run()
            or qwen3_next is None
            or not isinstance(inner, qwen3_next.Qwen3NextModel)
        ):
            return original(self, layers)
        inner._set_aux_hidden_state_layers(tuple(layers))
        return None

    return set_aux_hidden_state_layers
