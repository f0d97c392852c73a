"""``vllm-dualgpu plan``: GPU order, layer split and KV pool for a model, without a GPU.

Takes ``vllm serve``'s argument names (model, ``--max-model-len``, ``--kv-cache-dtype``,
``--speculative-config``, ``--block-size``, ...) plus ``--gpus`` to plan for cards that are not
here. With no arguments it plans the bundled Qwen3.8-27B-class reference on an RTX 4070 Ti
SUPER 16 GB + RTX 5090 32 GB pair. Imports neither vLLM nor torch; NVML only for ``--gpus local``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys

from vllm_dualgpu import envs
from vllm_dualgpu.cli.inputs import REFERENCE_PLACEHOLDER
from vllm_dualgpu.cli.inputs import UsageError as _Fail
from vllm_dualgpu.cli.inputs import read_config as _read_config
from vllm_dualgpu.cli.inputs import card_reserves as _card_reserves
from vllm_dualgpu.cli.inputs import with_default_reserves as _with_default_reserves
from vllm_dualgpu.planner.objective import DEFAULT_OBJECTIVE, OBJECTIVES, rule

_EPILOG = """\
--gpus syntax: comma-separated NAME[:TOTAL[:FREE]][:key=value...], in CUDA index order.
  Known cards need no size: --gpus "RTX 4070 Ti SUPER,RTX 5090"
  Sizes: 16GiB, 15.5GiB, 512MiB (binary), 16GB (decimal); a bare number is GiB.
  Keys: free=, reserve= (memory to leave free, e.g. for a desktop), bw= (GB/s), cc= (e.g. 8.9),
  display=yes|no (the card drives a desktop: 1 GiB kept free; no display: 256 MiB; unsaid: 1 GiB)
  Example: --gpus "RTX 4070 Ti SUPER:16GiB,RTX 5090:32GiB:30GiB:reserve=1GiB"
  --gpus local reads this machine's GPUs through NVML.
Exit status: 0 planned, 1 cannot be planned as asked (the message says what fits), 2 bad arguments.
"""


# `vllm serve` flags that do not change the plan: plan takes them and repeats them in its serve line.
KEPT_VALUE_FLAGS = ("--port", "--host", "--api-key", "--chat-template", "--tool-call-parser",
                    "--reasoning-parser", "--limit-mm-per-prompt", "--mm-processor-kwargs", "--tokenizer",
                    "--revision", "--download-dir", "--generation-config", "--override-generation-config",
                    "--kv-transfer-config")
KEPT_SWITCHES = ("--trust-remote-code", "--enable-auto-tool-choice", "--enable-chunked-prefill",
                 "--no-enable-flashinfer-autotune", "--async-scheduling", "--disable-custom-all-reduce",
                 "--enable-sleep-mode")


def _human_int(value: str) -> int:
    """vLLM's human_readable_int: 1k = 1000, 1K = 1024, 25.6k = 25600."""
    v = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", v)
    if m:
        num, suf = m.groups()
        if suf.islower():
            return int(float(num) * 10 ** (3 * "kmgt".index(suf) + 3))
        if "." in num:
            raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffix {suf}")
        return int(num) * 2 ** (10 * "KMGT".index(suf) + 10)
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def _int_or_auto(value: str) -> int:
    if value.strip().lower() in ("auto", "-1"):
        return -1
    return _human_int(value)


def _json_dict(value: str) -> dict:
    try:
        d = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return d


def _int_list(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {value!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan GPU order, layer split and KV pool (no GPU needed)",
        description=(
            "Plan how vLLM serves a model over mismatched GPUs with pipeline parallelism: which "
            "card is which rank, how many layers each holds, and how large the shared KV pool "
            "and the context can be. Without arguments: the bundled Qwen3.8-27B-class reference "
            "on an RTX 4070 Ti SUPER 16 GB + RTX 5090 32 GB pair."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="model directory holding config.json (or the config.json itself)")
    p.add_argument("--model", dest="model_opt", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--reference", default=None, help="bundled reference config: qwen3.8-27b (default) or qwen3-14b")
    p.add_argument("--gpus", help="cards to plan for (see below); default: this machine's, else the reference pair")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--max-model-len", type=_int_or_auto, help="context length to plan for (auto/-1: largest that fits)")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2 (default: auto; fp8 for the reference)",
    )
    p.add_argument("--block-size", type=int, help="KV block size in tokens")
    p.add_argument("--max-num-seqs", type=int, help="default: vLLM's default for device 0")
    p.add_argument("--max-num-batched-tokens", type=_human_int, help="default: vLLM's default for device 0")
    p.add_argument("--speculative-config", type=_json_dict, help="JSON, as for vllm serve")
    p.add_argument("-ac", "--attention-config", type=_json_dict,
                   help="JSON, as for vllm serve; the plan reads use_trtllm_attention (false: no FlashInfer XQA "
                        "decode, so no XQA workspace on an SM 9.0 / 12.x card)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, help="default: the number of GPUs")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="TP group size of each pipeline stage (cards of one kind; default 1)")
    p.add_argument("-q", "--quantization", help="vLLM's --quantization (e.g. fp8 for a 16-bit checkpoint)")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: the config's)")
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=_human_int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="for the stock-vLLM comparison")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on")
    p.add_argument("--mamba-cache-dtype", default="auto")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto")
    p.add_argument("--mamba-cache-mode", default=None, choices=("none", "align", "all"))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--language-model-only", action="store_true", help="no vision tower")
    p.add_argument(
        "--weight-format",
        default="auto",
        help="auto (read quantization_config), fp8, int8, int8-g128, nvfp4, w4a16, bf16, or per category "
        "'mlp=nvfp4,attention=fp8,linear_attention=fp8', or a format then categories 'int8-g128,embedding=int8-g128'",
    )
    p.add_argument(
        "--layer-partition",
        type=_int_list,
        help="layers per rank, e.g. 12,52 (default: $VLLM_PP_LAYER_PARTITION, else searched)",
    )
    p.add_argument("--gpu-order", type=_int_list, help="CUDA indices, rank 0 first (default: searched)")
    p.add_argument(
        "--objective",
        default=None,
        choices=OBJECTIVES,
        help="speed (default, $VLLM_DUALGPU_OBJECTIVE): the fastest predicted decode among the splits "
        "that hold --max-model-len (and --max-num-seqs such requests, where one does), then the largest "
        "pool; pool: the largest KV pool, the faster split among those within 1%% of it; auto: speed",
    )
    p.add_argument(
        "--profile",
        metavar="PATH|none",
        help="machine profile of measured bandwidths (vllm-dualgpu calibrate; default: "
        "$XDG_CACHE_HOME/vllm-dualgpu/machine-profile.json where it exists); none: datasheet figures",
    )
    p.add_argument("--drafter-shares-embedding", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vision-on-every-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--distributed-executor-backend", help=argparse.SUPPRESS)
    # Pasted from a `vllm serve` command line: not planned with, kept as given in the serve line.
    for flag in KEPT_VALUE_FLAGS:
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--served-model-name", nargs="+", help=argparse.SUPPRESS)
    for flag in KEPT_SWITCHES:
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)
    from vllm_dualgpu.cli import topology  # a box or a fleet: hosts separated by ';', or --fleet

    topology.add_to(p)


# ---------------------------------------------------------------------------------------------


def _gpus(args, have_model: bool):
    """(cards, notes): the cards ``plan`` plans for, as :func:`_cards` gives them."""
    gpus, notes, _ = _cards(args, have_model)
    return gpus, notes


def _cards(args, have_model: bool):
    """(cards, notes, the machine profile's use): each card's bandwidth is the profile's measured
    one where the profile names it (machine_profile.apply, which the executor calls too)."""
    from vllm_dualgpu import machine_profile

    gpus, notes, uuids = _gpus_as_given(args, have_model)
    explicit = args.gpus if args.gpus is not None and args.gpus.strip().lower() != "local" else None
    given = {i for i, entry in enumerate(explicit.split(",")) if "bw=" in entry} if explicit else set()
    reserves = _card_reserves(gpus, explicit)
    gpus = _with_default_reserves(gpus, explicit, reserves)
    note = _reserve_note(gpus, reserves, from_nvml=uuids is not None)
    used = machine_profile.apply(gpus, uuids, getattr(args, "profile", None), keep=given)
    return used.gpus, notes + ([note] if note else []), used


def _reserve_note(gpus, reserves, from_nvml: bool) -> str | None:
    """Why each card keeps what the table's "left free for others" row shows (no row, no note)."""
    from vllm_dualgpu import envs

    if not any(r.bytes for r in reserves):
        return None
    text = "left free for others: " + ", ".join(
        f"{r.bytes / 1024**3:.2f} GiB on [{g.index}] {g.short_name} ({r.why})" for g, r in zip(gpus, reserves))
    if not from_nvml and any(r.why == envs.DISPLAY_UNKNOWN for r in reserves):
        text += (f"; an unknown display is kept as an active one: write display=no in a headless card's --gpus "
                 f"entry ({envs.HEADLESS_RESERVE_BYTES / 1024**3:.2f} GiB) or display=yes")
    return text


def _profile_env(args) -> str | None:
    """The ``VLLM_DUALGPU_MACHINE_PROFILE`` the serve line needs for the executor to read the
    profile ``--profile`` named (None: the executor reads the same one by default)."""
    from pathlib import Path

    from vllm_dualgpu import machine_profile

    asked = getattr(args, "profile", None)
    if asked is None:
        return None
    default = machine_profile.default_path()
    if asked.strip().lower() == machine_profile.NONE:
        return machine_profile.NONE if default is not None and default.exists() else None
    asked = Path(asked).expanduser().resolve()
    return None if default is not None and default.expanduser().resolve() == asked else str(asked)


_BY_HAND = ("name the cards instead, in CUDA order: --gpus 'RTX 5090,RTX 4070 Ti SUPER' (a card plan "
            "does not know with its memory: 'NAME:24GiB'); vllm-dualgpu doctor says what NVML lacks")


def _gpus_as_given(args, have_model: bool):
    from vllm_dualgpu.planner import parse_gpus, reference_pair

    notes = []
    if args.gpus is not None and args.gpus.strip().lower() != "local":
        return parse_gpus(args.gpus), notes, None
    if args.gpus is not None or have_model:
        try:
            from vllm_dualgpu.nvml import read_visible_gpus, to_gpu_facts

            seen = read_visible_gpus()  # honours CUDA_VISIBLE_DEVICES, as vLLM does
            local = to_gpu_facts(seen)
        except Exception as e:  # no driver, no pynvml, no GPU
            if args.gpus:
                raise _Fail(f"--gpus local: cannot read GPUs through NVML ({e}); {_BY_HAND}") from None
            local = []
        if local:
            return local, notes, [g.uuid for g in seen]
        if args.gpus:
            raise _Fail(f"--gpus local: NVML sees no GPU here; {_BY_HAND}")
        notes.append("no GPUs visible here: planning for the reference pair (RTX 5090 + RTX 4070 Ti SUPER)")
    return reference_pair(), notes, None


def _serve_command(model_arg: str, p, args, objective_env: str | None = None) -> str:
    """The ``vllm serve`` line that serves this plan: every argument given to ``plan`` that
    changes it, in vLLM's spelling (``plan`` takes the same line back and plans the same).
    ``objective_env``: the ``VLLM_DUALGPU_OBJECTIVE`` it needs (:func:`_objective_env`)."""
    q = shlex.quote
    env = []
    if "layer_partition" in p.overrides:
        env.append(f"VLLM_PP_LAYER_PARTITION={p.overrides['layer_partition']}")
    if objective_env:
        env.append(f"VLLM_DUALGPU_OBJECTIVE={objective_env}")
    profile_env = _profile_env(args)
    if profile_env:
        env.append(f"VLLM_DUALGPU_MACHINE_PROFILE={q(profile_env)}")
    parts = env + ["vllm serve", q(model_arg)]
    if not p.passthrough:
        parts.append(f"--pipeline-parallel-size {len(p.partition)}")
        if args.tensor_parallel_size > 1:
            parts.append(f"--tensor-parallel-size {args.tensor_parallel_size}")
        backend = "dualgpu-ray" if args.distributed_executor_backend == "dualgpu-ray" else "dualgpu"
        parts.append(f"--distributed-executor-backend {backend}")
    parts.append(f"--max-model-len {p.max_model_len}")
    if args.quantization:
        parts.append(f"--quantization {q(args.quantization)}")
    if args.dtype != "auto":
        parts.append(f"--dtype {q(args.dtype)}")
    if args.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {q(args.kv_cache_dtype)}")
    if args.speculative_config:
        spec = {k: v for k, v in args.speculative_config.items() if k != "draft_config"}
        parts.append(f"--speculative-config {q(json.dumps(spec))}")
    if args.attention_config:
        parts.append(f"--attention-config {q(json.dumps(args.attention_config))}")
    for flag, value in (
        ("--block-size", args.block_size),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--num-gpu-blocks-override", args.num_gpu_blocks_override),
        ("--kv-cache-memory-bytes", args.kv_cache_memory_bytes),
        ("--mamba-cache-mode", args.mamba_cache_mode),
    ):
        if value is not None:
            parts.append(f"{flag} {q(str(value))}")
    for flag, value in (("--mamba-cache-dtype", args.mamba_cache_dtype),
                        ("--mamba-ssm-cache-dtype", args.mamba_ssm_cache_dtype)):
        if value != "auto":
            parts.append(f"{flag} {q(value)}")
    if args.enable_prefix_caching is not None:
        parts.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.enforce_eager:
        parts.append("--enforce-eager")
    if args.language_model_only:
        parts.append("--language-model-only")
    return " ".join(parts + _kept_flags(args))


def _objective_env(p, model, gpus, req) -> str | None:
    """The ``VLLM_DUALGPU_OBJECTIVE`` the serve line needs to be planned as ``p`` was: "pool"
    where the pool rule chose the split and the default would not choose it again (asked for;
    a card with no known bandwidth here, which the executor may read through NVML;
    ``--max-model-len auto``, whose printed length the default may plan on another split)."""
    from dataclasses import replace

    from vllm_dualgpu import planner as P

    if p.passthrough or p.objective == rule(DEFAULT_OBJECTIVE, False):
        return None
    if req.objective == p.objective or p.predicted_decode_ms is None:
        return p.objective
    again = P.fit(model, gpus, replace(req, max_model_len=p.max_model_len)).plan
    return None if (again.order, again.partition) == (p.order, p.partition) else p.objective


def _kept_flags(args) -> list[str]:
    """The user's flags that ``plan`` does not plan with, as given (in a fixed order)."""
    q = shlex.quote
    parts = []
    for flag in KEPT_VALUE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            parts.append(f"{flag} {q(value)}")
    if args.served_model_name:
        parts.append("--served-model-name " + " ".join(q(n) for n in args.served_model_name))
    parts += [flag for flag in KEPT_SWITCHES if getattr(args, flag[2:].replace("-", "_"), False)]
    return parts


STOCK_MODELLED = "0.30.0"  # the release whose sizing planner.stock_estimate follows


def _stock_line(s, part_text: str) -> str:
    from vllm_dualgpu.support import installed_vllm_version

    installed = installed_vllm_version()
    other = f"; vLLM {installed} is installed" if installed and installed != STOCK_MODELLED else ""
    head = (
        f"Stock vLLM, as {STOCK_MODELLED} sizes it{other} (GPUs {','.join(map(str, s.order))} in CUDA "
        f"order, even split {part_text}, one --gpu-memory-utilization for all ranks): "
    )
    if s.boots:
        at = f"at {s.gpu_memory_utilization:.2f} it boots with {s.num_blocks:,} blocks ({s.pool_tokens:,} tokens)"
    else:
        at = f"at {s.gpu_memory_utilization:.2f} it fails: {s.reason}"
    if s.best_utilization is None:
        best = "; it does not boot at any utilization"
    elif s.best_utilization != s.gpu_memory_utilization:
        if s.best_boots:
            best = (
                f"; the highest that boots, {s.best_utilization:.2f}, gives {s.best_num_blocks:,} blocks "
                f"({s.best_pool_tokens:,} tokens, max context {s.best_max_context_tokens:,})"
            )
        else:
            best = f"; at {s.best_utilization:.2f}, the highest its free-memory check allows, {s.best_reason}"
    else:
        best = ""
    return head + at + best + "."


def _support_notes() -> list[str]:
    """Said when the installed vLLM is one the dualgpu backend refuses (as doctor says it)."""
    from vllm_dualgpu.support import CHECKED_RELEASES, installed_vllm_version, unsupported_reason

    version = installed_vllm_version()
    reason = unsupported_reason(version) if version is not None else None
    return [f"{reason}; this plan assumes vLLM {CHECKED_RELEASES[-1]}"] if reason else []


def request_from_args(args, model, gpus):
    """The PlanRequest of these ``vllm serve``-style arguments: the executor builds the same one
    from the VllmConfig of the same command (engine/planning.plan_request), and both take what
    the runtime will do on the installed vLLM from patching/runtime.py."""
    from vllm_dualgpu import planner as P
    from vllm_dualgpu.envs import allow_long_max_model_len, objective
    from vllm_dualgpu.patching.runtime import runtime_assumptions

    spec = dict(args.speculative_config) if args.speculative_config else None
    if spec and spec.get("model") and str(spec.get("method", "")).lower() not in ("mtp", "ngram", "ngram_gpu", "suffix"):
        dcfg, _ = _read_config(str(spec["model"]))
        spec["draft_config"] = dcfg
    layer_partition = args.layer_partition
    if layer_partition is None and os.environ.get("VLLM_PP_LAYER_PARTITION"):
        layer_partition = _int_list(os.environ["VLLM_PP_LAYER_PARTITION"])
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    pp = args.pipeline_parallel_size or (len(layer_partition) if layer_partition else len(gpus) // tp)
    runtime = runtime_assumptions().request_fields()
    if args.vision_on_every_rank:
        runtime["vision_on_every_rank"] = True
    if args.drafter_shares_embedding:
        runtime["drafter_shares_embedding"] = True
    return P.PlanRequest(
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs or 0,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative=spec,
        pp_size=pp,
        layer_partition=layer_partition,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        model_dtype=model.dtype if args.dtype == "auto" else args.dtype,
        gpu_order=args.gpu_order,
        objective=args.objective or objective(),
        enable_prefix_caching=args.enable_prefix_caching is not False,
        mamba_cache_mode=args.mamba_cache_mode,
        mamba_cache_dtype=args.mamba_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        enforce_eager=args.enforce_eager,
        language_model_only=args.language_model_only,
        allow_long_max_model_len=allow_long_max_model_len(),
        xqa=(args.attention_config or {}).get("use_trtllm_attention") is not False,
        **runtime,
    )


def _print_error(e, as_json: bool, command: str | None = None) -> None:
    """A refusal: one line on stderr, or its fields as JSON on stdout (with ``command``, the
    serve line at the largest length that fits)."""
    if as_json:
        err = {"error": type(e).__name__, "message": str(e)}
        for k in ("largest_fitting_max_model_len", "requested", "rank", "gpu_name", "short_bytes", "partition"):
            if hasattr(e, k):
                err[k] = getattr(e, k)
        if command is not None:
            err["command"] = command
        print(json.dumps(err, indent=2))
    else:
        print(f"vllm-dualgpu plan: {e}", file=sys.stderr)


def _placeholder_lines(model_arg: str, source: str) -> list[str]:
    """For a plan of the bundled reference: what to put where the serve line says MODEL."""
    if model_arg != REFERENCE_PLACEHOLDER:
        return []
    return [f"  (MODEL: put your checkpoint's folder there, the directory with its config.json. This "
            f"plan is of the {source}, a set of shapes and not a checkpoint: plan your checkpoint "
            "first, vllm-dualgpu plan /path/to/checkpoint ...)"]


def _tp_stages(args, cfg: dict, gpus, req):
    """``-tp N``: the TP groups as pipeline stages, as the executor forms them (None for -tp 1)."""
    from vllm_dualgpu.planner.tp_stages import plan_stages

    tp = args.tensor_parallel_size
    if tp < 1:
        raise _Fail("--tensor-parallel-size must be >= 1")
    if tp == 1:
        return None
    if args.gpu_order:
        raise _Fail(f"--gpu-order with -tp {tp}: the plan orders the TP stages (the executor does the "
                    "same); choose the cards and their PCI order with --gpus")
    if req.pp_size < 2:
        raise _Fail(
            f"-tp {tp} with -pp {req.pp_size} is one TP group: stock vLLM's tensor parallelism "
            f"(vllm serve MODEL --tensor-parallel-size {tp}), which the dualgpu executor does not "
            f"plan. Give -pp 2 or more ({2 * tp}+ cards), or compare topologies with --gpus 'box=...'"
        )
    return plan_stages(cfg, gpus, req.pp_size, tp, req, weight_format=args.weight_format,
                       quantization=args.quantization)


def _tp_ranks(stages, p) -> list[dict]:
    """vLLM's ranks in order: each rank's stage, TP rank and card (its --gpus position)."""
    return [{"rank": i, "stage": st, "tp_rank": t, "gpu": g.index, "name": g.name}
            for i, (st, t, g) in enumerate(stages.rank_cards(p.order))]


def _tp_lines(stages, ranks: list[dict]) -> str:
    lines = [f"TP {stages.tp} groups as pipeline stages (the columns above are one TP rank of each "
             f"stage: weights and KV split 1/{stages.tp}, embedding and head vocabulary-parallel, "
             f"norms whole; each rank also keeps {stages.extra_reserve_bytes / 1024**3:.2f} GiB for "
             "the full-vocabulary sampler and the TP group's NCCL buffers; the GPU order above names "
             "each stage by its first card):"]
    for st in range(len(stages.stages)):
        cards = [r for r in ranks if r["stage"] == st]
        lines.append(f"  stage {st}: " + " + ".join(f"rank {r['rank']} GPU {r['gpu']} {r['name']}" for r in cards))
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Question:
    """What ``vllm-dualgpu plan`` asks the planner, built from its arguments: the model, the cards
    (the machine profile's bandwidths applied), the request, and what the printout says about them.
    Benchmarks and tests that must ask what ``plan`` asks build it with :func:`ask`."""

    model: object  # planner.ModelSpec (with TP stages: one stage's)
    gpus: list  # planner cards, in the order given (with TP stages: one stand-in a stage)
    request: object  # planner.PlanRequest
    notes: list
    source: str  # the printout's "(...)": the config file, or the bundled reference
    model_arg: str  # MODEL as the serve line writes it
    stages: object  # cli TP stages, or None
    profile: object  # machine_profile.Applied
    allocator: object = None  # envs.AllocatorChoice: what the executor sets for its workers


def question(args) -> Question:
    """``plan``'s question from its parsed arguments; raises ``UsageError`` or ``PlanError`` with
    the line ``plan`` prints."""
    from vllm_dualgpu import planner as P

    model_arg = args.model or args.model_opt
    if model_arg and args.reference:
        raise _Fail("give a model or --reference, not both")
    if model_arg:
        cfg, source = _read_config(model_arg)
    else:
        ref = args.reference or "qwen3.8-27b"
        cfg = P.reference_config(ref)
        source = f"bundled reference {ref}"
        model_arg = REFERENCE_PLACEHOLDER
        for k, v in ((cfg.get("_vllm_dualgpu") or {}).get("serve") or {}).items():
            if getattr(args, k, None) is None:
                setattr(args, k, v)
    if args.kv_cache_dtype is None:
        args.kv_cache_dtype = "auto"
    model = P.ModelSpec.from_hf_config(cfg, weight_format=args.weight_format, quantization=args.quantization)
    gpus, notes, profile = _cards(args, bool(args.model or args.model_opt))
    notes += _support_notes()
    req = request_from_args(args, model, gpus)
    stages = _tp_stages(args, cfg, gpus, req)
    if stages is not None:
        model, gpus, req = stages.model, list(stages.cards), stages.request
        notes += list(stages.notes)
    allocator = envs.allocator_choice(
        tp_size=args.tensor_parallel_size, custom_all_reduce=not args.disable_custom_all_reduce,
        sleep_mode=args.enable_sleep_mode, kv_transfer=args.kv_transfer_config is not None)
    return Question(model, gpus, req, notes, source, model_arg, stages, profile, allocator)


def ask(argv: list[str]) -> Question:
    """The question ``vllm-dualgpu plan ARGV...`` asks (``argv`` without the word ``plan``)."""
    from vllm_dualgpu.cli import build_parser

    return question(build_parser().parse_args(["plan", *argv]))


def run(args) -> int:
    from vllm_dualgpu import planner as P

    try:
        q = question(args)
    except _Fail as e:
        print(f"vllm-dualgpu plan: {e}", file=sys.stderr)
        return 2
    except P.PlanError as e:
        print(f"vllm-dualgpu plan: {e}", file=sys.stderr)
        return 2 if isinstance(e, P.BadRequest) else 1
    model, gpus, req, notes, source = q.model, q.gpus, q.request, q.notes, q.source
    model_arg, stages, profile = q.model_arg, q.stages, q.profile
    if profile.warning:
        print(f"vllm-dualgpu plan: warning: {profile.warning}", file=sys.stderr)

    try:
        # with TP stages the cards are stand-ins for groups: no VLLM_DUALGPU_RESERVE value to name
        f = P.fit(model, gpus, req, reserve_hint=stages is None)
        if f.plan.passthrough:  # one GPU or -pp 1: stock vLLM on the first GPU, which must hold it all
            f = P.fit_stock(model, gpus, req)
    except P.PlanError as e:
        _print_error(e, args.json)
        return 2 if isinstance(e, P.BadRequest) else 1
    if not f.fits:
        command = _serve_command(model_arg, f.plan, args, _objective_env(f.plan, model, gpus, req))
        _print_error(f.error, args.json, command=command)
        if not args.json:
            print(f"\nThe plan at --max-model-len {f.plan.max_model_len:,}:\n", file=sys.stderr)
            print(f.plan.table(), file=sys.stderr)
            print(f"Serve it at --max-model-len {f.plan.max_model_len:,}, the largest that fits:", file=sys.stderr)
            print(f"  {command}", file=sys.stderr)
            for line in _placeholder_lines(model_arg, source):
                print(line, file=sys.stderr)
        return 1
    p = f.plan
    if not p.passthrough:  # the executor's setting for its workers (engine/planning.allocator_for_workers)
        notes = [*notes, q.allocator.line()]

    stock = None
    if not p.passthrough and stages is None:  # stock vLLM's TP x PP takes cards in CUDA order
        try:
            stock = P.stock_estimate(model, gpus, req, args.gpu_memory_utilization)
        except P.PlanError:
            stock = None
    command = _serve_command(model_arg, p, args, _objective_env(p, model, gpus, req))
    ranks = _tp_ranks(stages, p) if stages is not None else None
    if args.json:
        out = {"source": source, "plan": p.to_dict(), "stock": stock.to_dict() if stock else None,
               "command": command, "notes": notes, "trade_line": p.trade_line()}
        if profile.line or profile.warning:
            out["profile"] = profile.to_dict()
        if ranks is not None:
            out["tp"] = {"size": stages.tp, "ranks": ranks}
            out["plan"]["cuda_visible_devices"] = ",".join(str(r["gpu"]) for r in ranks)  # every card, rank order
        print(json.dumps(out, indent=2))
        return 0

    print(f"vllm-dualgpu plan ({source})")
    if profile.line:
        print(profile.line)
    for n in notes:
        print(f"Note: {n}")
    print(p.table(), end="")
    trade = p.trade_line()  # the pool objective's split, when the speed rule chose another
    if trade:
        print(trade)
    if ranks is not None:
        print(_tp_lines(stages, ranks))
    if stock is not None:
        print(_stock_line(stock, "/".join(map(str, stock.partition))))
    if not p.passthrough:
        print()
        print("Serve it with the dualgpu executor, which applies this GPU order, split and memory plan:")
        print(f"  {command}")
        for line in _placeholder_lines(model_arg, source):
            print(line)
        visible = p.cuda_visible_devices() if ranks is None else ",".join(str(r["gpu"]) for r in ranks)
        print(f"(by hand: CUDA_VISIBLE_DEVICES={visible} VLLM_PP_LAYER_PARTITION={p.partition_env()})")
    else:
        print()
        print("Serve it as stock vLLM (one GPU):")
        print(f"  {command}")
        for line in _placeholder_lines(model_arg, source):
            print(line)
    return 0
