"""Turn a VllmConfig plus the GPUs NVML sees into a plan, and apply it before workers spawn.

Runs in the EngineCore process (no CUDA context there). What it changes:
- ``parallel_config.assigned_physical_gpu_ids``: which GPU each pipeline rank uses (the card
  with the most memory last: it holds the output head and the drafter);
- ``VLLM_PP_LAYER_PARTITION`` (unless the user set it): the layer split, vLLM's interface for it;
- ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE`` (unless the user set it, and where a rank runs
  FlashInfer): the plan's workspace size (envs.export_flashinfer_workspace);
- ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (unless the user configured torch's
  allocator, or the run needs fixed segments: envs.allocator_choice) for the workers;
- ``additional_config["dualgpu"]["plan"]``: each rank's reserve, cap and predicted costs, read
  once by each worker (:mod:`vllm_dualgpu.engine.handoff`);
- ``parallel_config.worker_cls``: :class:`vllm_dualgpu.engine.worker.DualGpuWorker`, which gives each
  rank its own memory budget (free memory minus a reserve) and logs one summary line;
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA and NVML number the GPUs the same way.
The cards' bandwidths are the machine profile's measured ones where ``vllm-dualgpu calibrate``
wrote one (:func:`measured_bandwidths`, the same function ``plan`` applies).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from vllm_dualgpu import envs, virtual_gpus
from vllm_dualgpu.engine import handoff, kv_pricing, partition
from vllm_dualgpu.nvml import VisibleGpu, read_visible_gpus
from vllm_dualgpu.log import logger

STOCK_WORKER = "vllm.v1.worker.gpu_worker.Worker"
OUR_WORKER = "vllm_dualgpu.engine.worker.DualGpuWorker"
GiB = 1024**3


@dataclass
class AppliedPlan:
    plan: object  # vllm_dualgpu.planner.Plan
    gpus: list[VisibleGpu]  # in vLLM's rank order
    tp_size: int = 1  # each pipeline stage's TP group


def speculative_dict(vllm_config) -> dict | None:
    sc = vllm_config.speculative_config
    if sc is None:
        return None
    out = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens}
    backend = getattr(sc, "attention_backend", None)  # the drafter's own (the launchers' DRAFT_ATTN)
    if backend is not None:
        out["attention_backend"] = getattr(backend, "name", str(backend))
    draft = getattr(sc, "draft_model_config", None)
    if draft is not None and draft.model != vllm_config.model_config.model:
        out["model"] = draft.model
        out["draft_hf_config"] = draft.hf_config.to_dict()
        # vLLM's resolved value: the target's TP size, or 1 (planner/tp_stages.py)
        if getattr(sc, "draft_tensor_parallel_size", None):
            out["draft_tensor_parallel_size"] = sc.draft_tensor_parallel_size
    return out


def plan_request(vllm_config, user_partition: list[int] | None):
    from vllm_dualgpu.patching.runtime import runtime_assumptions
    from vllm_dualgpu.planner import PlanRequest

    mc, cc, sc = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
    return PlanRequest(
        max_model_len=-1 if mc.original_max_model_len == -1 else mc.max_model_len,
        kv_cache_dtype=str(cc.cache_dtype),
        # vLLM fills in 16 when --block-size is absent; only the user's own value is an override
        # (the planner raises the default for hybrid models as vLLM's workers do).
        block_size=cc.block_size if getattr(cc, "user_specified_block_size", True) else None,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        speculative=speculative_dict(vllm_config),
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
        layer_partition=user_partition,
        num_gpu_blocks_override=cc.num_gpu_blocks_override,
        kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
        model_dtype=str(mc.dtype).removeprefix("torch."),
        objective=envs.objective(),
        enable_prefix_caching=bool(cc.enable_prefix_caching),
        mamba_cache_mode=getattr(cc, "mamba_cache_mode", None),
        mamba_cache_dtype=str(getattr(cc, "mamba_cache_dtype", "auto")),
        mamba_ssm_cache_dtype=str(getattr(cc, "mamba_ssm_cache_dtype", "auto")),
        enforce_eager=bool(mc.enforce_eager),
        allow_long_max_model_len=envs.allow_long_max_model_len(),
        xqa=getattr(getattr(vllm_config, "attention_config", None), "use_trtllm_attention", None) is not False,
        # What the registry's patches (or vLLM itself) make the ranks hold on this release;
        # `vllm-dualgpu plan` asks the same function.
        **runtime_assumptions().request_fields(),
    )


def choose_gpus(visible: list[VisibleGpu], pp_size: int, tp_size: int = 1) -> list[VisibleGpu]:
    from vllm_dualgpu.planner.tp_stages import too_few_cards

    need = pp_size * tp_size
    why = too_few_cards(pp_size, tp_size, [g.name for g in visible])
    if why:
        raise ValueError(why)
    if len(visible) > need:
        logger.warning(
            "%d GPUs visible, %s=%d: using the first %d (%s); set CUDA_VISIBLE_DEVICES to choose "
            "others", len(visible),
            "pipeline_parallel_size" if tp_size == 1 else "pipeline_parallel_size x tensor_parallel_size",
            need, need, ", ".join(f"{g.physical_id}:{g.name}" for g in visible[:need]),
        )
    return visible[:need]


def apply_plan(vllm_config) -> AppliedPlan:
    from vllm_dualgpu.nvml import to_gpu_facts
    from vllm_dualgpu.planner.tp_stages import plan_stages

    pc = vllm_config.parallel_config
    pp = pc.pipeline_parallel_size
    order_env = os.environ.get("CUDA_DEVICE_ORDER")
    if os.environ.get("CUDA_VISIBLE_DEVICES") and order_env not in (None, "PCI_BUS_ID"):
        logger.warning(
            "CUDA_DEVICE_ORDER=%s: vllm-dualgpu reads CUDA_VISIBLE_DEVICES in PCI bus order "
            "(nvidia-smi's order) and sets CUDA_DEVICE_ORDER=PCI_BUS_ID", order_env,
        )
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"

    try:
        visible = read_visible_gpus()
    except ValueError:
        raise
    except Exception as exc:
        raise RuntimeError(
            f"vllm-dualgpu: cannot read the GPUs through NVML ({exc!r}). The dualgpu executor "
            "needs NVIDIA GPUs and their driver; on other hardware use "
            "--distributed-executor-backend mp."
        ) from exc
    settings = _settings(vllm_config)
    # VLLM_DUALGPU_VIRTUAL_GPUS: emulated cards on the first visible GPU (off unless set)
    visible, virtual = virtual_gpus.substitute(visible, settings.get("virtual_gpus"))
    # VLLM_DUALGPU_RESERVE, else each card's display state (`plan` asks the same function)
    reserves_visible = envs.card_reserves(settings["reserve_bytes"], [g.display for g in visible])
    tp = pc.tensor_parallel_size
    used = choose_gpus(visible, pp, tp)
    reserves = reserves_visible[: len(used)]
    user_partition = settings["user_partition"]
    caps = _utilization_caps(settings.get("gpu_memory_utilization"), [g.total_bytes for g in used])
    facts = measured_bandwidths(to_gpu_facts(used, [r.bytes for r in reserves], caps), used)
    request = plan_request(vllm_config, user_partition)
    stages = plan_stages(vllm_config.model_config.hf_config.to_dict(), facts, pp, tp, request,
                         quantization=vllm_config.model_config.quantization)
    for note in stages.notes:
        logger.info("vllm-dualgpu: %s", note)
    model, cards, request = stages.model, list(stages.cards), stages.request
    # a refusal names the VLLM_DUALGPU_RESERVE value that fits where the cards are the visible GPUs
    hint = tp == 1 and len(used) == len(visible)
    result = plan_or_explain(model, cards, request, reserve_hint=hint)
    # Where vLLM is loaded its own (patched) KV functions price the split: plan and run agree.
    result, _ = kv_pricing.reprice(vllm_config, result, lambda groupings: plan_or_explain(
        model, cards, request, kv_groupings=groupings, reserve_hint=hint))

    # vLLM's rank r runs on assigned_physical_gpu_ids[r]: the multiprocess executor gives worker
    # r local_rank r (v1/executor/multiproc_executor.py:190 in 0.30.0, :206 in 0.33.0; one
    # node), and the platform maps that device id through the list (platforms/interface.py:300
    # in 0.30.0, :303 in 0.33.0); ranks are stage x tp + tp_rank (planner/tp_stages.rank_cards).
    placed = stages.rank_cards(result.order)
    ranked = [used[card.index] for _, _, card in placed]  # facts are indexed by position in used
    pc.assigned_physical_gpu_ids = [g.physical_id for g in ranked]
    cards = [virtual[card.index] for _, _, card in placed] if virtual else None
    if virtual:
        _virtual_ranks(vllm_config, cards)
    why = [reserves[card.index].why for _, _, card in placed]  # each rank's card's reason
    record = _handoff(result, ranked, user_partition, stages, cards, why)
    hand_over(vllm_config, record, off="per-rank memory budgets and summary lines",
              kept="the GPU order and layer split", workspace_bytes=result.flashinfer_workspace_bytes)
    allocator_for_workers(vllm_config)
    for line in _overrides(vllm_config, user_partition):
        logger.info(line)
    logger.info(
        "vllm-dualgpu plan: %s %s, layers %s, predicted KV pool %s blocks, max context %s tokens",
        "ranks" if tp == 1 else f"TP {tp} stages",
        " -> ".join(" + ".join(_gpu_text(g) for g in ranked[i:i + tp]) for i in range(0, len(ranked), tp)),
        "/".join(str(n) for n in result.partition),
        f"{result.num_blocks:,}",
        f"{result.max_context_tokens:,}",
    )
    logger.info("vllm-dualgpu: %s", kept_free_line(record))
    for warning in result.warnings:  # a hand-set pool the plan finds tight: it runs as set
        logger.warning("vllm-dualgpu: %s", warning)
    trade = result.trade_line()  # the pool objective's split, when the speed rule chose another
    if trade:
        logger.info("%s", trade)
    _write_plan_file(result, ranked, [card.index for _, _, card in placed])
    return AppliedPlan(result, ranked, tp)


def measured_bandwidths(facts: list, gpus: list[VisibleGpu]) -> list:
    """The cards with the machine profile's measured read bandwidths (``vllm-dualgpu calibrate``,
    matched by NVML UUID) through the function ``plan`` uses; logs which profile, in plan's words."""
    from vllm_dualgpu import machine_profile

    used = machine_profile.apply(facts, [g.uuid for g in gpus])
    if used.warning:
        logger.warning("vllm-dualgpu: %s", used.warning)
    if used.line:
        logger.info("%s", used.line)
    return used.gpus


def hand_over(vllm_config, record: handoff.Handoff, off: str, kept: str, workspace_bytes: int = 0) -> None:
    """Give the workers the plan: the split for vLLM (unless the user's or vLLM's own), FlashInfer's
    workspace size (``workspace_bytes``, the plan's; 0: vLLM's or the user's), the per-rank record,
    and the worker class that reads it. ``off``/``kept``: what a user's own worker class loses and
    what still applies, for its WARNING."""
    pc = vllm_config.parallel_config
    partition.export(record.partition if record.partition_source == "plan" else None)
    envs.export_flashinfer_workspace(workspace_bytes)
    if workspace_bytes:
        logger.info("vllm-dualgpu: FlashInfer workspace %d MiB (%s=%d; vLLM's default is 394 MiB)",
                    workspace_bytes >> 20, envs.FLASHINFER_WORKSPACE, workspace_bytes)
    handoff.store(vllm_config, record)
    if pc.worker_cls == STOCK_WORKER:
        pc.worker_cls = OUR_WORKER
    else:
        logger.warning("worker_cls=%s is not vLLM's GPU worker: %s are off; %s still apply",
                       pc.worker_cls, off, kept)


def allocator_choice(vllm_config) -> envs.AllocatorChoice:
    """``envs.allocator_choice`` for this run's config (``plan`` asks it from its flags)."""
    pc = vllm_config.parallel_config
    mc = getattr(vllm_config, "model_config", None)
    return envs.allocator_choice(
        tp_size=pc.tensor_parallel_size, custom_all_reduce=not pc.disable_custom_all_reduce,
        sleep_mode=bool(getattr(mc, "enable_sleep_mode", False)),
        kv_transfer=getattr(vllm_config, "kv_transfer_config", None) is not None)


def allocator_for_workers(vllm_config) -> envs.AllocatorChoice:
    """Export torch's allocator setting for the workers the multiprocess executor spawns (they
    inherit it; torch reads it at a worker's first CUDA allocation) and say so."""
    choice = allocator_choice(vllm_config)
    envs.export_allocator(choice)
    logger.info("vllm-dualgpu: %s", choice.line())
    return choice


def kept_free_line(record: handoff.Handoff) -> str:
    """What each rank keeps free on its card and why (the worker budgets free memory minus it)."""
    return "; ".join(
        f"rank {r.rank} on GPU {r.physical_gpu_id} ({r.gpu_name}): "
        + envs.Reserve(r.reserve_bytes, r.reserve_reason or "reason not recorded").text()
        for r in record.ranks)


def _gpu_text(g: VisibleGpu) -> str:
    return f"{g.physical_id}:{g.name} ({g.free_bytes / GiB:.1f}/{g.total_bytes / GiB:.1f} GiB free)"


def _settings(vllm_config) -> dict:
    """The front end's capture of the user's settings (preflight); captured here when the
    executor was selected without the front end's wrapper (a class passed directly)."""
    settings = handoff.frontend_settings(vllm_config)
    if "reserve_bytes" not in settings:
        from vllm_dualgpu.engine import preflight

        preflight.capture_settings(vllm_config)
        settings = handoff.frontend_settings(vllm_config)
    return settings


def _virtual_ranks(vllm_config, cards) -> None:
    """Every rank on the one physical GPU: vLLM's custom all-reduce (CUDA IPC between distinct
    GPUs) is off for TP stages, NCCL (its socket transport between the ranks' own host ids,
    engine/virtual_card.activate) carries everything. Says so when a rank's attention kernels
    will compile on first use (virtual_gpus.ptx_compile_warning)."""
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 and not pc.disable_custom_all_reduce:
        pc.disable_custom_all_reduce = True
    for rank, c in enumerate(cards):
        logger.info("vllm-dualgpu: virtual GPUs (%s): rank %d is %s", virtual_gpus.ENV, rank, c.describe())
    attention = getattr(vllm_config, "attention_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    mc = getattr(vllm_config, "model_config", None)
    mm = getattr(mc, "multimodal_config", None)
    line = virtual_gpus.ptx_compile_warning(
        cards, getattr(cache, "cache_dtype", None), getattr(attention, "backend", None),
        model_dtype=getattr(mc, "dtype", None), use_mla=bool(getattr(mc, "use_mla", False)),
        multimodal=mm is not None, mm_backend=getattr(mm, "mm_encoder_attn_backend", None))
    if line:
        logger.warning("vllm-dualgpu: %s", line)


def _handoff(result, ranked: list[VisibleGpu], user_partition, stages=None,
             cards=None, why: list[str] | None = None) -> handoff.Handoff:
    """The per-rank record the workers read (see engine/handoff.py for what it may hold): one a
    vLLM rank, each rank of a TP group with its stage's plan and its own card's reserve and cap
    (``stages``: planner/tp_stages.TpStages; None: a pipeline of single cards; ``why``: each
    rank's reason for its reserve, ``envs.Reserve.why``)."""
    if stages is not None:
        placed, tp, extra = stages.rank_cards(result.order), stages.tp, stages.extra_reserve_bytes
    else:
        placed, tp, extra = [(p, 0, r.gpu) for p, r in enumerate(result.ranks)], 1, 0
    ranks = []
    for rank, ((stage, tp_rank, card), g) in enumerate(zip(placed, ranked)):
        r = result.ranks[stage]
        context = r.fixed_detail.get("cuda_context", 0)
        after = r.reserve_detail.get("flashinfer_workspace", 0) + r.reserve_detail.get("xqa_workspace", 0)
        ranks.append(handoff.RankRecord(
            rank=rank,
            physical_gpu_id=g.physical_id,
            gpu_name=g.name,
            reserve_bytes=card.reserve_bytes,
            cap_bytes=card.cap_bytes,
            num_layers=r.num_layers,
            # What vLLM's profile will charge besides the KV cache: the planner's fixed costs,
            # weights and reserves, less the CUDA context vLLM's start snapshot already holds,
            # plus what a TP rank needs beyond its shard (its stage card's extra reserve), less
            # what vLLM allocates after sizing the pool (the worker takes it off vLLM's budget).
            predicted_non_kv_bytes=r.budget_bytes - r.kv_budget_bytes - context + extra - after,
            after_profile_bytes=after,
            stage=stage,
            tp_rank=tp_rank,
            virtual_card=cards[rank] if cards else None,
            reserve_reason=why[rank] if why else None,
        ))
    source = "user" if user_partition is not None else ("plan" if result.partition_env() else "even")
    return handoff.Handoff(tuple(ranks), tuple(result.partition), source, tp)


def plan_or_explain(model, facts, request, kv_groupings=None, reserve_hint: bool = False):
    """The plan at the requested length, or the planner's ContextTooLong (what fits, what to do).

    A length the plan predicts short, however little, is refused here, before any weights load:
    after profiling each rank's KV room is at most the plan's KV budget
    (:func:`vllm_dualgpu.engine.context_fit.cap_to_plan`) and the context is checked on those
    figures with vLLM's arithmetic, so vLLM's measurement cannot make it fit."""
    from vllm_dualgpu.planner import fit

    f = fit(model, facts, request, kv_groupings=kv_groupings, reserve_hint=reserve_hint)
    if f.fits:
        return f.plan
    raise f.error


def _write_plan_file(result, ranked: list[VisibleGpu], positions: list[int] | None = None,
                     extra: dict | None = None) -> None:
    """``VLLM_DUALGPU_PLAN_FILE=path``: keep the applied plan as JSON (for tools and tests);
    ``extra``: more top-level keys (dualgpu-ray: the nodes' facts and the bundles)."""
    path = os.environ.get(envs.PLAN_FILE)
    if not path:
        return
    data = result.to_json()
    data = json.loads(data) if isinstance(data, str) else dict(data)
    data["physical_gpu_ids"] = [g.physical_id for g in ranked]
    # every rank's card (its position among the visible GPUs): with TP stages the plan's own
    # order names only each stage's first card (across Ray nodes the plan's order stands)
    if positions is not None:
        data["cuda_visible_devices"] = ",".join(map(str, positions))
    data["partition"] = list(result.partition)
    data.update(extra or {})
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _utilization_caps(util: float | None, totals: list[int]) -> list[int] | None:
    """An explicit --gpu-memory-utilization caps each rank at that share of its total."""
    return None if util is None else [int(util * t) for t in totals]


def _overrides(vllm_config, user_partition) -> list[str]:
    cc = vllm_config.cache_config
    out = []
    if user_partition is not None:
        out.append(f"VLLM_PP_LAYER_PARTITION={','.join(map(str, user_partition))} set by the user: using it as the layer split")
    if cc.num_gpu_blocks_override is not None:
        out.append(f"--num-gpu-blocks-override {cc.num_gpu_blocks_override} set by the user: every rank gets that many blocks (not checked against free memory by vLLM)")
    if cc.kv_cache_memory_bytes is not None:
        out.append(f"--kv-cache-memory-bytes {cc.kv_cache_memory_bytes} set by the user: every rank reserves that much for KV")
    return out
