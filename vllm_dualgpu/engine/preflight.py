"""Checks that run in the front end right after vLLM built its config, before any process starts.

Everything that can be known from the config and the environment is checked here, so a wrong
setting ends ``vllm serve`` with one clear message instead of a failed engine process. What
needs the GPUs' free memory is checked by the executor (EngineCore) and, after profiling, by
:mod:`vllm_dualgpu.engine.context_fit`.
"""

from __future__ import annotations

import os

from vllm_dualgpu import envs
from vllm_dualgpu.engine import handoff, partition
from vllm_dualgpu.log import logger
from vllm_dualgpu.planner.gpus import parse_gpus
from vllm_dualgpu.virtual_gpus import ENV as VIRTUAL_GPUS

# Speculative methods that relay auxiliary hidden states between pipeline stages. vLLM relays
# them for a model whose decoder class declares it: these model types' decoders (LlamaModel,
# Qwen2Model, Qwen3Model) do in vLLM 0.30 to 0.33; for others aux_pp.py asks the class.
AUX_METHODS = ("eagle3", "dflash", "dspark", "extract_hidden_states")
AUX_PP_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Model types whose decoder (Qwen3NextModel, Qwen3_5Model) relays them through the registry's
# patches, in the workers; the text-only Qwen3.5 classes also need their layers set through
# vLLM's mixin.
AUX_RELAY_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
AUX_RELAY_PATCHES = ("qwen3-next-aux-hidden-relay", "qwen3-next-aux-hidden-flag")
AUX_RELAY_TEXT_ONLY_PATCH = "qwen3-5-aux-hidden-layers"
AUX_RELAY_TEXT_ONLY_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


class PreflightError(ValueError):
    """A refusal of this package: the message says what was wrong and what to do."""


def is_debug_logging() -> bool:
    """vLLM's debug logging (VLLM_LOGGING_LEVEL=DEBUG): then refusals keep their traceback."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper() == "DEBUG"


REFUSED = "__vllm_dualgpu_refused__"
"""Marks an exception :func:`refuse` has logged (its ERROR line said it all)."""


def refuse(error: BaseException) -> None:
    """Log ``error`` as one ERROR line, first, and keep its traceback off the terminal.

    The caller re-raises, so ``LLM(...)`` users get the exception to catch. Left uncaught (as
    in ``vllm serve``), Python's last step prints the traceback; a hook installed here prints
    nothing more for a refused exception (also when vLLM wrapped it) unless vLLM's debug
    logging is on. The hook is installed once however many refusals there are, and puts the
    process's previous hook back at its first call; every other exception goes to that one.
    """
    import sys

    logger.error("%s", error)
    if is_debug_logging():
        return
    setattr(error, REFUSED, True)
    if getattr(sys.excepthook, REFUSED, False):
        return
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if sys.excepthook is excepthook:
            sys.excepthook = previous
        seen, cause = set(), exc
        while cause is not None and id(cause) not in seen:
            if getattr(cause, REFUSED, False):
                return
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        previous(exc_type, exc, tb)

    setattr(excepthook, REFUSED, True)
    sys.excepthook = excepthook


def num_hidden_layers(vllm_config) -> int:
    return vllm_config.model_config.get_total_num_hidden_layers()


def check(vllm_config, nvml_gpu_count: int | None = None) -> list[str]:
    """Raise PreflightError for the first fatal problem; return warnings (already logged)."""
    pc = vllm_config.parallel_config
    warnings: list[str] = []
    if pc.pipeline_parallel_size < 2:
        return warnings
    capture_settings(vllm_config, nvml_gpu_count)
    if nvml_gpu_count is not None:
        if nvml_gpu_count < pc.world_size:
            raise PreflightError(
                f"--pipeline-parallel-size {pc.pipeline_parallel_size} x --tensor-parallel-size "
                f"{pc.tensor_parallel_size} needs {pc.world_size} GPUs, but {nvml_gpu_count} "
                f"{'is' if nvml_gpu_count == 1 else 'are'} visible. Lower the sizes or check "
                "CUDA_VISIBLE_DEVICES."
            )
    _check_drafter(vllm_config)
    cc = vllm_config.cache_config
    if cc.kv_cache_memory_bytes is not None and os.environ.get(envs.RESERVE):
        warnings.append(
            f"--kv-cache-memory-bytes is set: every rank takes exactly that for KV and "
            f"{envs.RESERVE} no longer shapes the KV pool"
        )
    if cc.kv_cache_memory_bytes is not None and cc.num_gpu_blocks_override is not None:
        warnings.append(
            "--kv-cache-memory-bytes and --num-gpu-blocks-override are both set: vLLM sizes "
            "the pool from --num-gpu-blocks-override"
        )
    for w in warnings:
        logger.warning("vllm-dualgpu: %s", w)
    return warnings


def capture_settings(vllm_config, nvml_gpu_count: int | None = None) -> None:
    """Read the user's settings once, here, and hand them to the executor in the config.

    ``VLLM_DUALGPU_RESERVE`` (checked against the visible GPU count once NVML gives it; None
    when unset: the executor then keeps each card's default by its display state) and the
    user's own ``VLLM_PP_LAYER_PARTITION`` (checked as vLLM will check it) go into
    ``additional_config["dualgpu"]``; the executor reads them from there.
    """
    reserve_text = os.environ.get(envs.RESERVE)
    sizes = envs.parse_reserve_sizes(reserve_text)  # None: unset, each card by its display
    if nvml_gpu_count is not None and sizes is not None:
        envs.expand_reserves(sizes, nvml_gpu_count, reserve_text)
    user_partition = envs.parse_partition(
        partition.users_partition_text(), num_hidden_layers(vllm_config),
        vllm_config.parallel_config.pipeline_parallel_size,
    )
    handoff.update_settings(vllm_config, reserve_bytes=sizes, user_partition=user_partition,
                            virtual_gpus=_virtual_gpus_text())


def _virtual_gpus_text() -> str | None:
    """``VLLM_DUALGPU_VIRTUAL_GPUS`` (an emulation for tests, docs/virtual-gpus.md), its syntax
    checked here; the executor places the cards once NVML has given the physical GPU."""
    text = os.environ.get(VIRTUAL_GPUS, "").strip()
    if text:
        _virtual_cards(text)
    return text or None


def _virtual_cards(text: str) -> list:
    """The cards of a ``VLLM_DUALGPU_VIRTUAL_GPUS`` value (``plan --gpus`` syntax), or a
    ValueError naming the variable."""
    try:
        return parse_gpus(text)
    except ValueError as exc:
        raise ValueError(f"{VIRTUAL_GPUS}: {exc}") from None


def check_platform(parallel_config) -> None:
    """The executor plans NVIDIA GPUs only; say so before any process starts (called when an
    engine is about to start, not for a config built on its own)."""
    from vllm.platforms import current_platform

    from vllm_dualgpu.engine.plan_scope import planning_applies

    if planning_applies(parallel_config) is None and not current_platform.is_cuda():
        raise PreflightError(
            f"vllm-dualgpu: the dualgpu executor needs NVIDIA GPUs, but vLLM runs on its "
            f"'{current_platform.device_name}' platform here. Use --distributed-executor-backend "
            "mp on this machine."
        )


def needs_aux_relay(sc) -> bool:
    """Whether speculative config ``sc`` reads the target's auxiliary hidden states, which under
    PP must be relayed between stages: vLLM 0.33's ``requires_aux_hidden_states``
    (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:15-22; tests/integration/engine/
    test_aux_methods.py holds this to it). An EAGLE3 drafter whose ``eagle_config`` says
    ``use_aux_hidden_state: false`` reads none."""
    if sc.method == "eagle3":
        hf = getattr(getattr(sc, "draft_model_config", None), "hf_config", None)
        return bool((getattr(hf, "eagle_config", None) or {}).get("use_aux_hidden_state", True))
    return sc.method in AUX_METHODS


def _check_drafter(vllm_config) -> None:
    sc = vllm_config.speculative_config
    if sc is None or not needs_aux_relay(sc):
        return
    model_type = getattr(vllm_config.model_config.hf_text_config, "model_type", "")
    if model_type in AUX_PP_MODEL_TYPES:
        return  # LlamaModel, Qwen2Model, Qwen3Model: no registry subprocess for the common case
    from vllm_dualgpu.engine import aux_pp
    from vllm_dualgpu.support import installed_vllm_version

    refused = (f"--speculative-config method '{sc.method}' needs auxiliary hidden states relayed "
               f"between pipeline stages, which vLLM {installed_vllm_version()} does not do for "
               f"model type '{model_type}'")
    todo = ("Use method 'mtp' (if the model has MTP layers), run without speculative decoding, or "
            "use --pipeline-parallel-size 1.")
    if model_type in AUX_RELAY_MODEL_TYPES:
        architectures = getattr(vllm_config.model_config.hf_config, "architectures", None) or ()
        problem = aux_relay_problem(architectures)
        if not problem:
            return
        raise PreflightError(f"{refused}, and the vllm-dualgpu patches that do cannot apply here: "
                             f"{problem}. {todo}")
    relay = aux_pp.find(vllm_config.model_config)
    if relay.relays:
        return
    if relay.relays is False:
        raise PreflightError(f"{refused} ({relay.model_class}: its decoder {relay.decoder_class} does not "
                             f"declare {aux_pp.FLAG}). {todo}")
    model = relay.model_class or "the model's class"
    raise PreflightError(f"{refused} as far as vllm-dualgpu can tell: the decoder class of {model} was "
                         f"not found ({relay.why}) and, without it, only model types "
                         f"{', '.join(AUX_PP_MODEL_TYPES)} are accepted. {todo}")


def aux_relay_problem(architectures=()) -> str:
    """Why the auxiliary-hidden-state relay of the Qwen3-Next/Qwen3.5 family would not be in
    place in the workers, or "" when it would.

    The patches apply in the workers; here each one is checked as core's checks would check it
    (declared, vLLM version in range, target with the expected parameters and pinned source),
    reading vLLM's files instead of importing its model modules in the front end.
    """
    from vllm_dualgpu.patching.core import version_in_range
    from vllm_dualgpu.patching.registry import PATCHES
    from vllm_dualgpu.patching.source_check import check_in_file
    from vllm_dualgpu.support import installed_vllm_version

    names = list(AUX_RELAY_PATCHES)
    if set(architectures) & set(AUX_RELAY_TEXT_ONLY_ARCHS):
        names.append(AUX_RELAY_TEXT_ONLY_PATCH)
    declared = {p.name: p for p in PATCHES}
    version = installed_vllm_version()
    for name in names:
        patch = declared.get(name)
        if patch is None:
            return f"patch {name} is not in the registry"
        if not version_in_range(version, patch.vllm_versions):
            return f"patch {name} is written for vLLM {patch.vllm_versions}, found {version}"
        reason = check_in_file(patch.target, patch.params, patch.source_sha256)
        if reason:
            return f"patch {name}: {reason}"
    return ""


def nvml_gpu_count() -> int | None:
    """Visible GPUs by NVML, or None when NVML is unavailable (then the executor decides)."""
    try:
        import pynvml

        from vllm_dualgpu.nvml import visible_physical_ids

        pynvml.nvmlInit()
        try:
            count = len(visible_physical_ids(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
        virtual = os.environ.get(VIRTUAL_GPUS, "").strip()
        # the virtual cards all sit on the first visible GPU (docs/virtual-gpus.md)
        return len(_virtual_cards(virtual)) if virtual and count >= 1 else count
    except ValueError:
        raise
    except Exception:
        return None
