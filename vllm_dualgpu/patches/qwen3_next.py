"""Patches of ``vllm.model_executor.models.qwen3_next``: the Qwen3-Next / Qwen3.5 decoder relays
auxiliary hidden states across pipeline stages.

EAGLE3 and DFlash drafters read hidden states of a few target layers (the auxiliary hidden
states). Under PP those layers sit on several stages, while the drafter runs on the last one.
vLLM 0.30 relays them for the decoders that declare ``supports_aux_hidden_states_over_pp``
(``Qwen2Model``, ``LlamaModel``): each stage puts the states it captured into the
``IntermediateTensors`` it sends (keys ``aux_hidden_states_<slot>``, numbered from
``_aux_slot_base_cached``, the count of requested layers on earlier stages), the runner reserves
those keys in the receive buffers (``reserve_aux_intermediate_tensor_slots``) and forwards the
upstream ones through middle stages (``PPHandler.relay_aux_hidden_states``), and the last stage
puts the upstream states before its own (``collect_remote_aux_hidden_states``). Anything else is
refused by ``verify_supports_aux_hidden_states_over_pp``.

``Qwen3NextModel.forward`` (inherited by ``Qwen3_5Model``, the decoder of every Qwen3.5 model)
captures auxiliary states but sends only ``hidden_states``/``residual`` on, so the states of
earlier stages are lost. :func:`relay_forward` is that forward with the relay of
``Qwen2Model.forward`` added, line for line: the upstream states are read right after the
intermediate tensors, the input state is captured as layer ``start_layer`` on the first stage
only (vLLM's Qwen3-Next captures "layer 0" on every stage, which under PP would take a later
stage's input for the embedding), the local states are packed into the tensors sent on, and the
last stage returns upstream + local states after its norm. The sequence-parallel gather is kept
as vLLM has it (vLLM disables sequence parallelism under PP, so the gather only ever sees local
states). Without PP, or with no auxiliary layers, it computes exactly what vLLM's forward does.

The declaration (``supports_aux_hidden_states_over_pp``) is made per instance by the
``qwen3-next-aux-hidden-flag`` patch, only when this forward is in place; the patch pins the
source of vLLM's forward (``Patch.source_sha256``) and skips on any other.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from itertools import islice

import torch
from vllm.distributed import get_pp_group, tensor_model_parallel_all_gather
from vllm.model_executor.models.utils import sequence_parallel_chunk
from vllm.sequence import IntermediateTensors

RELAY_FORWARD_PATCH = "qwen3-next-aux-hidden-relay"
"""Name of the registry entry that installs :func:`relay_forward` (its sentinel value)."""

QUALNAME = "Qwen3NextModel.forward_with_aux_relay"
"""The replacement's ``__qualname__``. vLLM keys its AOT compile cache on the forward's qualname
and first line (``_model_hash_key``); a name of its own keeps a graph compiled from vLLM's forward
from being loaded for this one."""


def relay_forward(
    self,
    input_ids: torch.Tensor | None,
    positions: torch.Tensor,
    intermediate_tensors: IntermediateTensors | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
    if get_pp_group().is_first_rank:
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]

    # From Qwen2Model.forward: the states captured on earlier stages.
    remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)

    full_num_tokens = positions.shape[-1]
    if self.use_sequence_parallel:
        hidden_states = sequence_parallel_chunk(hidden_states)
        assert residual is None

    aux_hidden_states: list[torch.Tensor] = []
    if get_pp_group().is_first_rank:
        self._maybe_add_hidden_state(
            aux_hidden_states, self.start_layer, hidden_states, residual
        )
    for layer_idx, layer in enumerate(
        islice(self.layers, self.start_layer, self.end_layer),
        start=self.start_layer,
    ):
        hidden_states, residual = layer(
            positions=positions,
            hidden_states=hidden_states,
            residual=residual,
        )
        self._maybe_add_hidden_state(
            aux_hidden_states, layer_idx + 1, hidden_states, residual
        )

    if not get_pp_group().is_last_rank:
        return IntermediateTensors(
            {
                "hidden_states": hidden_states,
                "residual": residual,
                **self.pack_local_aux_hidden_states(aux_hidden_states),
            }
        )
    hidden_states, _ = self.norm(hidden_states, residual)
    if self.use_sequence_parallel:
        if aux_hidden_states:
            hidden_size = hidden_states.shape[-1]
            hidden_states = torch.cat([hidden_states, *aux_hidden_states], dim=-1)
            hidden_states = tensor_model_parallel_all_gather(hidden_states, 0)
            hidden_states = hidden_states[:full_num_tokens]
            hidden_states, *aux_hidden_states = hidden_states.split(
                hidden_size, dim=-1
            )
        else:
            hidden_states = tensor_model_parallel_all_gather(hidden_states, 0)
            hidden_states = hidden_states[:full_num_tokens]
    aux_hidden_states = remote_aux + aux_hidden_states
    if aux_hidden_states:
        return hidden_states, aux_hidden_states
    return hidden_states


def wrap_forward(original: Callable) -> Callable:
    """A fresh copy of :func:`relay_forward` (no closure: vLLM's bytecode hook swaps the code of
    ``type(model).forward`` for the compiled one, which must keep the same free variables)."""
    forward = types.FunctionType(
        relay_forward.__code__,
        relay_forward.__globals__,
        "forward",
        relay_forward.__defaults__,
        None,
    )
    forward.__kwdefaults__ = relay_forward.__kwdefaults__
    forward.__annotations__ = dict(relay_forward.__annotations__)
    forward.__doc__ = original.__doc__
    forward.__module__ = relay_forward.__module__
    forward.__qualname__ = QUALNAME
    return forward


def relay_forward_applied(model_cls: type) -> bool:
    """Whether ``model_cls`` runs this package's relaying forward."""
    from vllm_dualgpu.patching.core import SENTINEL

    return getattr(getattr(model_cls, "forward", None), SENTINEL, None) == RELAY_FORWARD_PATCH
