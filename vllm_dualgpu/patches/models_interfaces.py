"""Patches of ``vllm.model_executor.models.interfaces``: the vision tower only on the first PP
rank; the auxiliary-hidden-state relay declaration of Qwen3-Next/Qwen3.5 decoders (see
:mod:`vllm_dualgpu.patches.qwen3_next`).

Multimodal models build their encoders inside ``SupportsMultiModal._mark_tower_model``; vLLM 0.30
replaces them with a weightless ``StageMissingLayer`` only when every modality is limited to 0
items, so under PP every rank builds and loads the vision tower although only the first rank
runs it (the V2 model runner keeps the encoder cache and encoder runner on the first rank only;
later ranks get ``model_state.supports_mm_inputs == False``). Under the dualgpu executor with
PP > 1 and the V2 runner, ranks after the first take the same weightless path vLLM takes for a
disabled modality, so they hold no vision weights. The first rank is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from vllm_dualgpu.patches.spec_common import is_dualgpu_pp, is_dualgpu_run, uses_v2_model_runner


def skips_tower_here(vllm_config) -> bool:
    """A later PP rank of a dualgpu run on the V2 model runner."""
    if not is_dualgpu_pp(vllm_config):
        return False
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank:
        return False
    return uses_v2_model_runner(vllm_config)


def stage_name_for(modalities: set[str]) -> str:
    """The StageMissingLayer name vLLM gives a tower of these modalities."""
    if modalities == {"image", "video"}:
        return "vision_tower"
    return "_".join([*modalities, "tower"])


def wrap_mark_tower_model(original: Callable) -> Callable:
    @contextlib.contextmanager
    def _mark_tower_model(self, vllm_config, modalities, *, targets=None):
        if not skips_tower_here(vllm_config):
            with original(self, vllm_config, modalities, targets=targets):
                yield
            return
        from vllm.model_executor.models.utils import (
            StageMissingLayer,
            collect_children,
            no_init_weights,
        )

        if isinstance(modalities, str):
            modalities = {modalities}
        stage_name = stage_name_for(modalities)
        with collect_children(self, targets=targets) as children_names:  # noqa: SIM117
            with no_init_weights(
                self, lambda mod: StageMissingLayer(stage_name, mod), targets=targets
            ):
                yield
        self._tower_model_names = children_names
        # Nothing was allocated on the device, so there is nothing to hand to an offloader.

    _mark_tower_model.__doc__ = original.__doc__
    _mark_tower_model.__qualname__ = getattr(original, "__qualname__", "_mark_tower_model")
    return _mark_tower_model


# --- EagleModelMixin._set_aux_hidden_state_layers: the Qwen3-Next/Qwen3.5 relay declaration ---

QWEN3_NEXT_MODULE = "vllm.model_executor.models.qwen3_next"


def declares_aux_relay(model) -> bool:
    """A Qwen3-Next/Qwen3.5 decoder whose class runs the relaying forward, in a dualgpu run."""
    import sys

    qwen3_next = sys.modules.get(QWEN3_NEXT_MODULE)
    if qwen3_next is None or not isinstance(model, qwen3_next.Qwen3NextModel):
        return False
    if not is_dualgpu_run():
        return False
    from vllm_dualgpu.patches.qwen3_next import relay_forward_applied

    return relay_forward_applied(type(model))


def wrap_set_aux_hidden_state_layers(original: Callable) -> Callable:
    """After vLLM's method (sorted layers, PP slot layout), a Qwen3-Next/Qwen3.5 decoder that runs
    the relaying forward (``qwen3-next-aux-hidden-relay``) declares
    ``supports_aux_hidden_states_over_pp`` on the instance, as Qwen2Model does on its class.
    vLLM reads it right after (``reserve_aux_intermediate_tensor_slots``, then
    ``verify_supports_aux_hidden_states_over_pp``). Every other decoder is left as vLLM made it,
    so without the forward patch vLLM still refuses EAGLE3/DFlash under PP for these models."""

    @functools.wraps(original)
    def _set_aux_hidden_state_layers(self, layers) -> None:
        original(self, layers)
        if declares_aux_relay(self):
            self.supports_aux_hidden_states_over_pp = True

    return _set_aux_hidden_state_layers
