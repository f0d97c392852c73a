"""``DualGpuWorker``: vLLM's GPU worker with a memory budget of its own card's free memory.

Stock vLLM asks every rank for ``gpu_memory_utilization x total`` and refuses to boot when a
card has less free. Here each rank's budget is what its card had free when the worker took its
snapshot (after its CUDA context and NCCL buffers exist) minus a per-card reserve, optionally
capped by an explicit ``--gpu-memory-utilization``. vLLM's own profiling then subtracts weights
and activations from that budget, so the KV pool of each rank is measured, not guessed.
"""

from __future__ import annotations

import os
import re
import sys

import torch
from vllm.v1.worker.gpu_worker import Worker

from vllm_dualgpu import envs, plugin
from vllm_dualgpu import rank_summary
from vllm_dualgpu.engine import handoff, profile_pass
from vllm_dualgpu.engine import virtual_card
from vllm_dualgpu.log import logger
from vllm_dualgpu.planner.gpus import rank_budget
from vllm_dualgpu.process import DEVICE, WORKER, note_worker_config

GiB = 1024**3


def kv_backing_bytes(kv_cache_config) -> int:
    """Bytes of this rank's KV cache. vLLM 0.30 places every ``KVCacheTensor`` in one backing
    allocation of ``size`` bytes (``v1/worker/utils.py``: the cache groups of a hybrid model
    overlay each other), so the sizes are not added up."""
    return max((t.size for t in kv_cache_config.kv_cache_tensors), default=0)


def pool_tokens(vllm_config, kv_cache_config) -> int | None:
    """The tokens this pool holds as vLLM counts them ("GPU KV cache size": requests of
    --max-model-len it holds at once, x that length): a request takes blocks in every KV cache
    group (a hybrid's attention and state groups, a drafter's own), so it is not blocks x block
    size where there is more than one group. None where vLLM cannot say (the summary line then
    says blocks x block size; it never stops a boot)."""
    try:
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
        return int(concurrency * vllm_config.model_config.max_model_len)
    except Exception:
        return None


def profiled_vs_predicted(requested: int, available_kv: int, predicted: int | None) -> str:
    """vLLM's profile of this rank (what it charges besides the KV cache) against the plan.

    vLLM sizes the KV cache from ``requested`` (this rank's budget) minus what its profile run
    measured: weights, the activation peak, and memory taken since its start snapshot (NCCL
    buffers, workspaces). ``predicted`` is the planner's figure for the same (the handoff's
    ``predicted_non_kv_bytes``); both are compared in bytes and per cent.
    """
    measured = requested - available_kv
    if predicted is None:
        return f"{_gib(measured)} (no plan to compare)"
    diff = measured - predicted
    err = 100.0 * diff / predicted if predicted else 0.0
    return (f"{_gib(measured)} measured by vLLM, predicted {_gib(predicted)} "
            f"({diff / 2**20:+.0f} MiB, {err:+.1f}%)")


def pp_receive_bytes(model_runner, tp_size: int = 1) -> int:
    """What a later pipeline stage holds of the batch it receives, at the largest batch: vLLM's
    ``Worker.execute_model`` receives the previous stage's tensors into new ones
    (``irecv_tensor_dict``) and keeps them through the step, while the profile pass reads the
    runner's persistent ``intermediate_tensors``, sized for the largest batch, instead. So the
    step needs that buffer's size again beside what the profile measured; twice with TP
    (``tp_size`` > 1), where each rank receives its slice into a full-size tensor and all-gathers
    it into another, both alive through the step. 0 on the first stage (no buffer)."""
    buffers = getattr(model_runner, "intermediate_tensors", None)
    if buffers is None:
        return 0
    tensors = getattr(buffers, "tensors", buffers)
    return sum(t.numel() * t.element_size() for t in tensors.values()) * (2 if tp_size > 1 else 1)


def _oom_detail(exc: BaseException) -> str:
    m = re.search(r"Tried to allocate [\d.]+ \w+", str(exc))
    return m.group(0) if m else str(exc).split(". ")[0]


def _end_this_process() -> None:
    """End the worker at once (flushing its log): vLLM then sees a dead worker and shuts the
    engine down, where an exception would leave the other rank waiting in a pipeline receive."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def external_weight_bytes(load_config, vllm_config) -> int:
    """Weights an external process holds on this GPU for vLLM 0.32+ (its model loader's
    ``get_external_weight_memory``); 0 where the loader has none or vLLM predates it."""
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(load_config)
    ask = getattr(loader, "get_external_weight_memory", None)
    return int(ask(vllm_config) or 0) if ask is not None else 0


def refuse_external_weights(load_config, vllm_config) -> None:
    """vLLM 0.32+ lets a model loader keep the weights in another process and charges them to
    the utilization budget. The dualgpu worker budgets free memory itself and has not been
    shown with such a loader: say so instead of vLLM's "Externally held weights ... exceed the
    desired GPU memory utilization" (its check meets the worker's 1e-6 utilization)."""
    held = external_weight_bytes(load_config, vllm_config)
    if held > 0:
        raise ValueError(
            f"vllm-dualgpu: this model loader holds {_gib(held)} of weights outside the worker "
            "process, which the dualgpu worker does not support yet; load the weights in the "
            "worker (the default loaders do) or use --distributed-executor-backend mp"
        )


def _activate_virtual_card(vllm_config, rank: int):
    """This rank's virtual card from the hand-off (VLLM_DUALGPU_VIRTUAL_GPUS), made active in
    this process before vLLM sets up the device; None on a real card."""
    plan = handoff.load(vllm_config) if hasattr(vllm_config, "additional_config") else None
    record = plan.rank(rank) if plan else None
    card = record.virtual_card if record else None
    if card is not None:
        virtual_card.activate(card, rank)
    return card


def _virtual_note(card, device) -> str:
    cap = virtual_card.hold_to_card(device)
    return f"{card.describe()}; NCCL host id {os.environ.get('NCCL_HOSTID')}; torch held to {_gib(cap)}"


#: Why this worker turns vLLM 0.34's extensible KV cache off (vLLM logs it with its own warning).
EXTENSIBLE_KV_OFF = ("vllm-dualgpu sizes each rank's KV cache from that rank's budget through vLLM's "
                     "memory profile, as its plan predicts; the extensible KV cache is not "
                     "supported under the dualgpu executors yet")


class DualGpuWorker(Worker):
    def __init__(self, *args, **kwargs):
        # This process is in a dualgpu run: its config carries the executor's plan. Model code,
        # which holds no config, asks process.is_dualgpu_run().
        config = kwargs.get("vllm_config", args[0] if args else None)
        note_worker_config(config)
        # The worker patches apply here, before the device and the model exist (register()
        # cannot tell which executor drives a worker; forked workers skip it).
        plugin.ensure_for_dualgpu(frozenset({WORKER}))
        super().__init__(*args, **kwargs)
        self._virtual_card = _activate_virtual_card(getattr(self, "vllm_config", config),
                                                    getattr(self, "rank", kwargs.get("rank", 0)))

    def init_device(self):
        refuse_external_weights(self.load_config, self.vllm_config)
        # vLLM refuses to boot when free < utilization x total. The real budget is set right
        # after the snapshot below, so pass that check with the smallest legal share first.
        self.cache_config.gpu_memory_utilization = 1e-6
        from vllm_dualgpu.engine.ray_planning import prepare_worker

        prepare_worker(self)  # dualgpu-ray: this node's GPUs in planned order (else nothing)
        super().init_device()
        # Patches whose vLLM module starts CUDA when imported, now that this rank's GPU is set.
        plugin.ensure_for_dualgpu(frozenset({DEVICE}))
        snap = self.init_snapshot
        plan = handoff.load(self.vllm_config)
        self._dualgpu_plan = plan
        self._dualgpu_rank = record = plan.rank(self.rank) if plan else None
        reserve = record.reserve_bytes if record else envs.DEFAULT_RESERVE_BYTES
        cap = record.cap_bytes if record else None
        after = record.after_profile_bytes if record else 0
        budget = rank_budget(snap.free_memory, reserve, cap, after)
        name = torch.cuda.get_device_name(self.device)
        if budget <= 0:
            raise ValueError(
                f"rank {self.rank} ({name}): {_gib(snap.free_memory)} free of "
                f"{_gib(snap.total_memory)} at start, reserve {_gib(reserve)}: nothing left for "
                f"vLLM. Free memory on this GPU or lower {envs.RESERVE}."
            )
        self.requested_memory = budget
        self.cache_config.gpu_memory_utilization = min(1.0, budget / snap.total_memory)
        if getattr(self, "_virtual_card", None) is not None:
            rank_summary.note("virtual GPU", _virtual_note(self._virtual_card, self.device))
        rank_summary.note("GPU", f"{name} (cuda:{self.device.index})")
        rank_summary.note(
            "budget",
            f"{_gib(budget)} = {_gib(snap.free_memory)} free - {_gib(reserve)} reserve"
            + (f" ({record.reserve_reason})" if record and record.reserve_reason else "")
            + (", capped by --gpu-memory-utilization" if cap is not None else "")
            + (f" - {_gib(after)} for FlashInfer's workspaces, which vLLM allocates after sizing the KV cache"
               if after else ""),
        )
        self._install_native_hooks()

    def _install_native_hooks(self) -> None:
        """This rank's CuTe DSL target, and per-device dispatch in vLLM's compiled library."""
        from vllm_dualgpu.kernels.flashinfer import set_cute_dsl_arch_for_current_device

        set_cute_dsl_arch_for_current_device()
        if os.environ.get("VLLM_DUALGPU_SM_HOOK", "1") == "0":
            rank_summary.note("sm-hook", "off (VLLM_DUALGPU_SM_HOOK=0)")
            return
        try:
            from vllm_dualgpu.kernels.sm_hook import install_sm_hook
        except ImportError as exc:  # the extension did not build or is missing
            logger.error("vllm-dualgpu: native sm hook unavailable (%s); kernels dispatch for GPU 0", exc)
            rank_summary.note("sm-hook", f"unavailable: {exc}")
            return
        try:
            install_sm_hook()
        except Exception as exc:
            logger.error("vllm-dualgpu: could not install the sm hook: %s", exc)
            rank_summary.note("sm-hook", f"failed: {exc}")

    def determine_available_memory(self) -> int:
        self._warm_pp_communicators()
        if getattr(self, "_virtual_card", None) is not None:
            virtual_card.hold_to_card(self.device)  # NCCL's buffers now count outside torch
        from_startup_plan = self._apply_vllms_startup_plan()
        if getattr(self.cache_config, "kv_cache_memory_bytes", None):
            available, split = self._set_kv_size_pass()
            source = "--kv-cache-memory-bytes"
            if from_startup_plan:
                # vLLM saved requested - non-KV - 150 MiB, which holds no received hidden states.
                available, received = self._less_received(available)
                source = (f"vLLM's startup plan (VLLM_ENABLE_STARTUP_PLAN, saved by an earlier boot; less "
                          f"{received / 2**20:.0f} MiB for the hidden states this rank receives)")
            weights = _gib(getattr(self.model_runner, "model_memory_usage", 0) or 0)
            # vLLM ran its profile pass but measured nothing: the KV size is the one set. What this
            # rank holds is torch's own figure, after the cache was emptied.
            held = (f"torch's peak {_gib(torch.cuda.max_memory_allocated(self.device))}, "
                    f"reserved {_gib(torch.cuda.memory_reserved(self.device))}")
            rank_summary.note("non-KV", f"not profiled ({'startup plan' if from_startup_plan else source}); {held}")
            logger.info("vllm-dualgpu rank %d: KV cache %s as set by %s; vLLM "
                        "skipped its memory profile, so the plan's non-KV figure is not checked; "
                        "weights %s, %s%s", self.rank, _gib(available), source, weights, held, split)
            return available
        # One unmeasured pass first (compilation, autotuning), then vLLM's measured one, which
        # vLLM runs under the allocator's split limit itself.
        first = profile_pass.first_profile_pass(self)
        if first:
            logger.info("vllm-dualgpu rank %d: %s", self.rank, first)
        available, received = self._less_received(super().determine_available_memory())
        weights = _gib(getattr(self.model_runner, "model_memory_usage", 0) or 0)
        record = getattr(self, "_dualgpu_rank", None)
        predicted = record.predicted_non_kv_bytes if record else None
        non_kv = profiled_vs_predicted(self.requested_memory, available, predicted)
        rank_summary.note("non-KV", non_kv)
        # Now, not only in the summary after the KV pool: a run refused at the KV check (or one
        # that dies allocating it) still says what each rank's profile found.
        held = (f" (less {received / 2**20:.0f} MiB for the hidden states it receives, which vLLM's "
                "profile does not hold)" if received else "")
        logger.info("vllm-dualgpu rank %d profiled: weights %s, non-KV %s, KV room %s of a %s budget%s",
                    self.rank, weights, non_kv, _gib(available), _gib(self.requested_memory), held)
        return available

    def extensible_kv_cache_unsupported_reason(self) -> str | None:
        """vLLM 0.34's extensible KV cache (on by default on CUDA) sizes the pool from memory
        measured after warm-up and graph capture. This worker sizes each rank's pool from its own
        budget through vLLM's profile, which is what the plan predicts; vLLM's engine asks every
        worker before it profiles and turns the feature off everywhere, logging this reason."""
        return EXTENSIBLE_KV_OFF

    def disable_extensible_kv_cache(self) -> None:
        """vLLM 0.34 recomputes ``requested_memory`` from the start snapshot here; keep this
        rank's budget."""
        budget = self.requested_memory
        super().disable_extensible_kv_cache()
        self.requested_memory = budget

    def _less_received(self, available: int) -> tuple[int, int]:
        """``available`` less the hidden states this rank receives from the stage before it (vLLM's
        profile does not hold them), and those bytes."""
        tp_size = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1) or 1
        received = pp_receive_bytes(self.model_runner, tp_size)
        return max(0, available - received), received

    def _apply_vllms_startup_plan(self) -> bool:
        """vLLM 0.33's ``VLLM_ENABLE_STARTUP_PLAN``: a KV size saved by an earlier boot, which vLLM
        sets on the first line of its ``determine_available_memory`` (v1/worker/gpu_worker.py:654)
        and then skips its profile. Applied here first, so that this rank takes the set-size path
        (no unmeasured warm-up pass, no "profiled" line for a size read from a file); vLLM's own
        call then finds the size set and applies nothing. True when a plan set the size."""
        try:
            from vllm.v1.worker.startup_plan import maybe_apply_startup_plan
        except ImportError:  # before vLLM 0.33
            return False
        if getattr(self.cache_config, "kv_cache_memory_bytes", None) is not None:
            return False
        maybe_apply_startup_plan(self)
        return getattr(self.cache_config, "kv_cache_memory_bytes", None) is not None

    def _set_kv_size_pass(self) -> tuple[int, str]:
        """vLLM's pass for a set KV size under the allocator split limit, which vLLM applies only
        to its measured profile (profile_pass.split_limited). Returns vLLM's KV bytes and a note
        for the log."""
        with profile_pass.split_limited(self) as split:
            available = super().determine_available_memory()
        return available, split

    def _warm_pp_communicators(self) -> None:
        """Create the pipeline's NCCL communicators now, so their buffers count before the KV pool.

        NCCL allocates a communicator's buffers on its first use. vLLM's pipeline uses two that
        are first used after the KV cache has taken the budget: the stage-to-stage sends of
        hidden states (``isend_tensor_dict`` on the PP device group) and the sampled-token
        broadcast (the v2 runner's ``PPHandler.broadcast_group``). On two H200s that came to
        more than a 1 GiB reserve and failed in warm-up ("unhandled cuda error"). Used here,
        before profiling, they are part of what vLLM measures since its start snapshot.
        """
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_pp_group

        g = get_pp_group()
        if g.world_size < 2:
            return
        free_before = torch.cuda.mem_get_info(self.device)[0]
        r = g.rank_in_group
        send = torch.zeros(64, dtype=torch.bfloat16, device=self.device)
        recv = torch.empty_like(send)
        handles = []
        if r + 1 < g.world_size:
            handles.append(dist.isend(send, dst=g.ranks[r + 1], group=g.device_group))
        if r > 0:
            handles.append(dist.irecv(recv, src=g.ranks[r - 1], group=g.device_group))
        for h in handles:
            h.wait()
        handler = getattr(self.model_runner, "pp_handler", None)
        if handler is not None and getattr(handler, "broadcast_group", None) is not None:
            tokens = torch.zeros(2, dtype=torch.int64, device=self.device)
            try:
                dist.broadcast(tokens, src=g.last_rank, group=handler.broadcast_group)
            except Exception as exc:  # e.g. NCCL_ALGO leaves broadcast no algorithm
                # vLLM's own first broadcast will meet the same; say so here, where it is clear.
                logger.warning(
                    "vllm-dualgpu rank %d: the pipeline's sampled-token broadcast failed before "
                    "profiling (%s); vLLM uses it for every step. NCCL_ALGO=%r, NCCL_PROTO=%r "
                    "(VLLM_BATCH_INVARIANT=1 sets allreduce:tree, which leaves broadcast none).",
                    self.rank, str(exc).splitlines()[0], os.environ.get("NCCL_ALGO"),
                    os.environ.get("NCCL_PROTO"))
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        rank_summary.note("pp comms", f"{_gib(used)} (NCCL buffers, counted before the KV pool)")

    def compile_or_warm_up_model(self):
        try:
            result = super().compile_or_warm_up_model()
        except torch.OutOfMemoryError as exc:
            self._exit_on_oom(exc)
        except Exception as exc:
            self._exit_on_warmup_error(exc)
        self._log_summary()
        return result

    def _exit_on_warmup_error(self, exc: BaseException) -> None:
        """Any other failure in warm-up: the same reason to end the worker as for OOM (no memory
        advice: the error is not about memory)."""
        try:
            name, state = self._gpu_state()
            logger.error(
                "vllm-dualgpu rank %d (%s) failed during warm-up, after the KV cache was sized "
                "(%s): %s. Ending this worker so the engine shuts down instead of waiting for it.",
                self.rank, name, state, exc, exc_info=exc,
            )
        finally:
            _end_this_process()

    def execute_model(self, *args, **kwargs):
        try:
            return super().execute_model(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            self._exit_on_oom(exc, "while serving")

    if hasattr(Worker, "sample_tokens"):  # vLLM 0.31+: sampling is a step of its own

        def sample_tokens(self, *args, **kwargs):
            try:
                return super().sample_tokens(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                self._exit_on_oom(exc, "while serving")

    def _exit_on_oom(self, exc: BaseException, when: str = "during warm-up, after the KV cache was sized") -> None:
        """Out of memory in warm-up or while serving: say what to change and end this worker.

        Returning the error is not enough: the other rank waits in a pipeline receive for this
        one, and vLLM's multiproc executor only hears errors from the output rank, so the
        engine would wait (in warm-up forever, while serving until
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS). A dead worker makes vLLM shut the engine down.
        The process ends whatever fails while the line is written.
        """
        try:
            name, state = self._gpu_state()
            record = getattr(self, "_dualgpu_rank", None)
            reserve = record.reserve_bytes if record else envs.DEFAULT_RESERVE_BYTES
            logger.error(
                "vllm-dualgpu rank %d (%s) ran out of memory %s (%s; reserve %s): %s. Keep more "
                "free on this GPU: raise its value in %s (e.g. %s), or lower "
                "--max-num-batched-tokens / --max-num-seqs.",
                self.rank, name, when, state, _gib(reserve), _oom_detail(exc), envs.RESERVE,
                _gib(reserve + GiB),
            )
        finally:
            _end_this_process()

    def _gpu_state(self) -> tuple[str, str]:
        """This rank's GPU name and free memory for an error line. After a sticky CUDA fault
        every CUDA call raises again: then say so instead of raising."""
        try:
            name = torch.cuda.get_device_name(self.device)
        except Exception:
            record = getattr(self, "_dualgpu_rank", None)
            name = record.gpu_name if record else f"device {self.device}"
        try:
            free, total = torch.cuda.mem_get_info(self.device)
        except Exception as err:
            return name, f"GPU memory unreadable after the error: {str(err).splitlines()[0]}"
        return name, f"{_gib(free)} free of {_gib(total)}"

    def _log_summary(self) -> None:
        if getattr(self, "_virtual_card", None) is not None:
            cap = virtual_card.hold_to_card(self.device)
            rank_summary.note("held to", f"{_gib(cap)} for torch (the card's free memory less "
                                         "what the process holds outside torch)")
        rank_summary.note("allocator", envs.allocator_in_effect())
        free, total = torch.cuda.mem_get_info(self.device)
        kv = self.cache_config.num_gpu_blocks
        pp_rank, pp_size = self._pp_position()
        plan = getattr(self, "_dualgpu_plan", None)
        split = plan.partition if plan and plan.partition_source != "even" else None
        rank_summary.note("layers", f"{split[pp_rank]} of {'/'.join(map(str, split))}" if split and len(split) == pp_size else "even split")
        rank_summary.note("weights", _gib(self.model_runner.model_memory_usage))
        rank_summary.note("KV", f"{_gib(getattr(self, '_dualgpu_kv_bytes', 0))}, {kv} blocks x {self.cache_config.block_size} tokens" if kv else "n/a")
        kv_tokens = (getattr(self, "_dualgpu_pool_tokens", None) or kv * self.cache_config.block_size) if kv else 0
        if kv_tokens:
            ctx = min(kv_tokens, self.model_config.max_model_len)
            rank_summary.note("max context", f"{ctx:,} tokens (pool {kv_tokens:,})")
        rank_summary.note("free after", _gib(free))
        logger.info(rank_summary.line(self._summary_prefix(pp_rank, pp_size, plan)))

    def _summary_prefix(self, pp_rank: int, pp_size: int, plan) -> str:
        """``rank P/N`` for a pipeline; with TP groups as stages, the global rank, its stage
        and its TP rank (from this rank's hand-off record, vLLM's layout otherwise)."""
        tp = plan.tp_size if plan else 1
        if tp == 1:
            return f"vllm-dualgpu rank {pp_rank}/{pp_size}: "
        record = getattr(self, "_dualgpu_rank", None)
        tp_rank = record.tp_rank if record else self.rank % tp
        return f"vllm-dualgpu rank {self.rank} (stage {pp_rank}/{pp_size}, TP rank {tp_rank}/{tp}): "

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        self._dualgpu_kv_bytes = kv_backing_bytes(kv_cache_config)
        self._dualgpu_pool_tokens = pool_tokens(self.vllm_config, kv_cache_config)
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks

    def _pp_position(self) -> tuple[int, int]:
        from vllm.distributed.parallel_state import get_pp_group

        g = get_pp_group()
        return g.rank_in_group, g.world_size
