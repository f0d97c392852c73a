"""Patches of ``vllm.model_executor.models.interfaces``: the vision tower only on the first PP
rank.

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
from collections.abc import Callable

from vllm_dualgpu.patches.spec_common import is_dualgpu_pp


def skips_tower_here(vllm_config) -> bool:
    """A later PP rank of a dualgpu run on the V2 model runner."""
    if not is_dualgpu_pp(vllm_config):
        return False
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank:
        return False
    return bool(vllm_config.use_v2_model_runner)


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
