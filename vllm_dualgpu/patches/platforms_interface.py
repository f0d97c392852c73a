"""Patch of ``vllm.platforms.interface.Platform.update_block_size_for_backend``: one block size
for every pipeline stage of a hybrid (Mamba/Gated DeltaNet + attention) model.

Each worker picks its KV block size after loading its own layers (vLLM 0.30
``v1/executor/multiproc_executor.py:694``). ``update_block_size_for_backend`` looks for the
stage's first attention backend that is not an SSM one (``platforms/interface.py:624``) and
returns early when there is none: a stage that holds only linear-attention layers keeps the
default 16 tokens, does not raise the block size so an attention page holds a Mamba state
(``_align_hybrid_block_size``) and, with ``mamba_cache_mode="align"``, never sets
``mamba_block_size``. The other stages raise it (144 tokens for the small Qwen3.5 test model).
EngineCore then schedules with the smallest block size of all stages (``v1/engine/core.py:345``),
so the stages disagree on where blocks, and the GDN states cached with them, begin. Seen on two
H200s: with the plugin's 1/7 split the engine ran with 16-token blocks where one GPU used 144,
and prefix caching hit nothing (a second cause, the since-removed ``mamba-hit-drop-last-block``
patch, was active in that run too; docs/gpu-runs.md).

vLLM's even split rarely leaves a stage without attention (Qwen3.5 has one every four layers);
the planner's uneven splits can. Under the dualgpu executor with PP > 1, a hybrid stage without
an attention layer asks vLLM's attention selector for the backend the model's attention layers
select (the arguments ``Attention.__init__`` passes, ``model_executor/layers/attention/
attention.py:347``) and runs vLLM's own block-size code with it, so every stage reaches the
same block size from the same model-wide facts. Other runs are unchanged.

vLLM 0.31 renamed the finder to ``_find_non_ssm_backends`` (a list of the stage's distinct
backends, empty for such a stage; 031 ``platforms/interface.py:665``, 033 ``:679``) and picks
the preferred size of all of them; the 0.31+ entries answer ``[backend]`` there instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from vllm_dualgpu.patches.spec_common import is_dualgpu_pp


#: vLLM's finder of the stage's attention backend, per release: (name, answer for a backend).
SINGLE = ("_find_non_ssm_backend", lambda backend: backend)  # 0.30: one class or None
PLURAL = ("_find_non_ssm_backends", lambda backend: [backend])  # 0.31+: a list, empty for none


def stage_needs_model_backend(cls, vllm_config, finder=SINGLE) -> bool:
    """A dualgpu PP stage of a hybrid, non-MLA model that holds no non-SSM attention layer."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not is_dualgpu_pp(vllm_config):
        return False
    if not model_config.is_hybrid or model_config.use_mla:
        return False
    return not getattr(cls, finder[0])(vllm_config)


def model_attention_backend(vllm_config):
    """The backend class the model's (decoder, full) attention layers select on this device."""
    import torch

    from vllm.config.vllm import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    mc = vllm_config.model_config
    dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.get_default_dtype()
    with set_current_vllm_config(vllm_config):
        return get_attn_backend(
            mc.get_head_size(),
            dtype,
            vllm_config.cache_config.cache_dtype,
            use_mla=False,
            use_mm_prefix=bool(getattr(mc, "is_mm_prefix_lm", False)),
            has_sliding_window=mc.get_sliding_window() is not None,
        )


@contextlib.contextmanager
def _stage_backend(cls, backend, finder=SINGLE):
    """vLLM's finder on ``cls`` answers ``backend`` inside the block (this process only;
    workers call it once, while they start)."""
    name, answer = finder
    missing = object()
    saved = cls.__dict__.get(name, missing)
    setattr(cls, name, classmethod(lambda _cls, _cfg: answer(backend)))
    try:
        yield
    finally:
        if saved is missing:
            delattr(cls, name)
        else:
            setattr(cls, name, saved)


def wrap_update_block_size_for_backend(original: Callable) -> Callable:
    """vLLM 0.30 (``_find_non_ssm_backend``)."""
    return _wrap(original, SINGLE)


def wrap_update_block_size_for_backends(original: Callable) -> Callable:
    """vLLM 0.31+ (``_find_non_ssm_backends``)."""
    return _wrap(original, PLURAL)


def _wrap(original: Callable, finder) -> Callable:
    def update_block_size_for_backend(cls, vllm_config) -> None:
        if not stage_needs_model_backend(cls, vllm_config, finder):
            return original(cls, vllm_config)
        from vllm_dualgpu.log import logger

        cache = vllm_config.cache_config
        try:
            backend = model_attention_backend(vllm_config)
        except Exception as exc:  # noqa: BLE001 - vLLM's own behaviour, loudly
            logger.warning(
                "vllm-dualgpu: this pipeline stage holds no attention layer and the model's "
                "attention backend could not be selected (%s); its block size stays %d tokens "
                "and may differ from the other stages' (prefix caching would then find "
                "nothing). Pass --block-size with the other stages' value.", exc, cache.block_size)
            return original(cls, vllm_config)
        before = cache.block_size
        with _stage_backend(cls, backend, finder):
            original(cls, vllm_config)
        logger.info(
            "vllm-dualgpu: this pipeline stage holds no attention layer; block size set from "
            "the model's %s attention like the other stages: %d -> %d tokens (mamba block size "
            "%s).", backend.get_name(), before, cache.block_size, cache.mamba_block_size)

    return update_block_size_for_backend
