#!/usr/bin/env python3
"""The vision tower on the first PP rank only (issue #6 item 3), on a small Qwen3.5 multimodal model.

    python scripts/gpu/vision_pp.py OUTDIR [--timeout S] [--dry-run]

Why: vLLM 0.30 builds and loads a multimodal model's vision tower on every PP rank, although with
the V2 model runner only the first rank runs it (model_executor/models/interfaces.py:367-379 puts
a weightless ``StageMissingLayer`` in its place only when every modality is limited to 0 items;
v1/worker/gpu/model_runner.py:269 and :939 keep the encoder cache and profile on the first rank).
The plugin's ``vision-tower-first-rank-only`` patch makes later ranks of a dualgpu run take that
weightless path. This script shows it on GPUs: "a vision config shows no vision weights on rank 1".

OUTDIR/model/ is a Qwen3.5 multimodal model (``Qwen3_5ForConditionalGeneration``, model_type
``qwen3_5``): the text model of spec_decode_pp.py (8 layers, hidden 1024, Gated DeltaNet + full
attention, no MTP; head_dim 256 and interleaved M-RoPE [11, 11, 10] as in Qwen3.5) and a 2-block
vision encoder (hidden 256, out_hidden_size = the text hidden size), dummy weights. vLLM needs the
HF processor offline: the engine core's scheduler, LLM's input processor and the first rank's
profile run all build ``MultiModalBudget`` (multimodal/encoder_budget.py:48-99), which loads
``Qwen3VLProcessor`` (qwen3_vl.py:914) and, for profiling, processes a dummy image
(encoder_budget.py:203, multimodal/registry.py:244). So the model folder also holds a tokenizer
(make_model.write_tokenizer plus the four vision special tokens; their ids go into config.json),
preprocessor_config.json (images of at most 512x512 pixels: profiling stays cheap) and
video_preprocessor_config.json (Qwen3VLVideoProcessor needs torchvision). Images are limited to
1 per prompt, videos to 0; a limit of 0 for images too would make stock vLLM skip the tower on
every rank and prove nothing.

Arms, each one ``vllm.LLM`` (PP=2, load_format="dummy", enforce_eager, gpu_memory_utilization 0.3,
max_model_len 4096, Triton GDN prefill) in a child process in its own process group, logging to
OUTDIR/<arm>-llm.log: ``dualgpu`` (distributed_executor_backend="dualgpu") first, then ``stock``
("mp"). Each generates greedily for two token-id prompts, then ``collective_rpc`` reads in every
worker: PP rank, pid, CUDA device, runner, the parameters under ``visual`` (count, bytes), the
class of ``visual`` (``StageMissingLayer`` where skipped), all parameter bytes and
torch.cuda.memory_allocated. ``--timeout`` (default 200 s) is for both arms together; the dualgpu
arm keeps STOCK_MIN_S for the stock arm, which gets what is left.

Checks (dualgpu arm): booted and generated, two ranks probed on the V2 runner, rank 0 holds vision
weights, rank 1 none, and every worker's plugin line ("vllm-dualgpu X.Y.Z (worker, pid ...):
applied ...") lists ``vision-tower-first-rank-only`` as applied. The stock arm is informational
(rank 1's vision bytes, expected > 0); a stock failure is recorded, not a failure. Results in
OUTDIR/vision_pp.json, a one-line summary on stdout; exit code 0 only if the checks hold.

``--dry-run`` (no GPU; sets VLLM_TARGET_DEVICE=cpu) writes the model folder and checks, on vLLM's
own objects: config and tokenizer ids, ``EngineArgs(...).create_engine_config()`` for both
executors (architecture, multimodal, M-RoPE, PP=2, image limit, V2 runner not blocked, the
plugin's preflight with 2 GPUs assumed), the patch's registry entry, and with torchvision
installed the HF processor and vLLM's profiling inputs (MultiModalBudget and
get_dummy_encoder_profile_inputs); without torchvision these are skipped with the reason recorded.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpurun import (  # noqa: E402
    applied_names, arms_main, attempt, gdn_prefill_config, kill_running_on_exit, registry_entry, run_child,
    workers_by_rank, write_child_result,
)
from spec_decode_pp import MODEL_CONFIG, _cpu_inspection_shim  # noqa: E402

PATCH = "vision-tower-first-rank-only"
VISION_ATTR = "visual"  # Qwen3_5ForConditionalGeneration.__init__, qwen3_5.py:513-519
ARMS = {"dualgpu": "dualgpu", "stock": "mp"}  # arm -> distributed_executor_backend
STOCK_MIN_S = 45.0
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
_SKIP = ("architectures", "model_type", "mtp_num_hidden_layers")
TEXT_CONFIG = {
    **{k: v for k, v in MODEL_CONFIG.items() if k not in _SKIP}, "model_type": "qwen3_5_text",
    "head_dim": 256,  # rotary dim 256 * 0.25 = 64 = 2 * sum(mrope_section), as in Qwen3.5
    "rope_parameters": {**MODEL_CONFIG["rope_parameters"], "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
VISION_CONFIG = {  # Qwen3_VisionTransformer (qwen3_vl.py:564-665); head_dim 256 / 4 = 64
    "model_type": "qwen3_5", "depth": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 2304, "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "deepstack_visual_indexes": [], "hidden_act": "gelu_pytorch_tanh",
}
IMAGE_PROCESSOR = {  # as Qwen3.5's own file, with at most 512x512 pixels per image
    "size": {"longest_edge": 512 * 512, "shortest_edge": 64 * 64}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PROCESSOR = {**{k: v for k, v in IMAGE_PROCESSOR.items() if k != "image_processor_type"},
                   "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4, "max_frames": 8}


def write_model(out: Path) -> Path:
    from make_model import write_tokenizer
    from transformers import AutoTokenizer

    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model, TEXT_CONFIG["vocab_size"])
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.save_pretrained(str(model))
    ids = {key: tok.convert_tokens_to_ids(t) for key, t in zip(TOKEN_KEYS, VISION_TOKENS)}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": TEXT_CONFIG, "vision_config": VISION_CONFIG, **ids,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (model / "config.json").write_text(json.dumps(config, indent=1))
    (model / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=1))
    (model / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=1))
    return model


def engine_kwargs(model: Path, arm: str) -> dict:
    return dict(model=str(model), load_format="dummy", pipeline_parallel_size=2,
                distributed_executor_backend=ARMS[arm], enforce_eager=True, max_model_len=4096,
                gpu_memory_utilization=0.3, seed=0, limit_mm_per_prompt={"image": 1, "video": 0},
                additional_config=gdn_prefill_config())


def prompts() -> list[list[int]]:
    """Two token-id prompts of ordinary tokens (ids below the tokenizer's vision tokens)."""
    return [[3 + (11 + 7 * i) % 600 for i in range(24)], [3 + (500 + 13 * i) % 600 for i in range(90)]]


# --- dry run (CPU) -----------------------------------------------------------------------------


def dry_run(out: Path, model: Path) -> int:
    import importlib.util

    has_tv = importlib.util.find_spec("torchvision") is not None  # before the shim stubs it
    shim = _cpu_inspection_shim()
    res: dict = {"mode": "dry-run", "shim": shim, "torchvision": has_tv}
    cfg_json = json.loads((model / "config.json").read_text())

    def files():
        from transformers import AutoConfig, AutoTokenizer

        hf, tok = AutoConfig.from_pretrained(str(model)), AutoTokenizer.from_pretrained(str(model))
        ids = {k: tok.convert_tokens_to_ids(t) for k, t in zip(TOKEN_KEYS, VISION_TOKENS)}
        return {"hf_config": type(hf).__name__, "vision_depth": hf.vision_config.depth, "token_ids": ids,
                "ids_match_config": all(cfg_json[k] == v for k, v in ids.items()),
                "ids_in_vocab": all(0 < v < hf.text_config.vocab_size for v in ids.values())}

    def engine(arm):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.models.registry import ModelRegistry

        cfg = EngineArgs(**engine_kwargs(model, arm)).create_engine_config()
        mc, backend = cfg.model_config, cfg.parallel_config.distributed_executor_backend
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
        facts = {"architectures": mc.architectures, "model_class": cls.__name__,
                 "is_multimodal": mc.is_multimodal_model, "is_hybrid": mc.is_hybrid, "uses_mrope": mc.uses_mrope,
                 "executor": getattr(backend, "__name__", str(backend)),
                 "pp": cfg.parallel_config.pipeline_parallel_size,
                 "image_limit": mc.get_multimodal_config().get_limit_per_prompt("image"),
                 "v2_runner_blockers": cfg._get_v2_model_runner_unsupported_features()}
        if arm == "dualgpu":
            from vllm_dualgpu.engine import preflight
            from vllm_dualgpu.patches.spec_common import is_dualgpu_pp

            facts["preflight_warnings"] = preflight.check(cfg, 2)  # raises if refused
            facts["is_dualgpu_pp"] = is_dualgpu_pp(cfg)
        return facts

    def processor():
        from transformers import AutoProcessor

        p = AutoProcessor.from_pretrained(str(model))
        return {"class": type(p).__name__, "image_processor": type(p.image_processor).__name__,
                "video_processor": type(p.video_processor).__name__, "image_token_id": p.image_token_id}

    def profiling_inputs():
        from vllm.engine.arg_utils import EngineArgs
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.encoder_budget import MultiModalBudget, get_dummy_encoder_profile_inputs

        cfg = EngineArgs(**engine_kwargs(model, "dualgpu")).create_engine_config()
        budget = MultiModalBudget(cfg, MULTIMODAL_REGISTRY, enable_cache=False)  # as profile_run
        items = get_dummy_encoder_profile_inputs(MULTIMODAL_REGISTRY, budget)
        grid = items[0][1].get_data()["image_grid_thw"] if items else None
        return {"max_tokens_per_item": dict(budget.mm_max_toks_per_item),
                "encoder_budget": budget.get_encoder_budget(), "items": len(items),
                "modality": items[0][0] if items else None, "image_grid_thw": grid.tolist() if grid is not None else None}

    res["files"] = attempt(files)
    res["engine"] = {arm: attempt(lambda a=arm: engine(a)) for arm in ARMS}
    res["patch"] = attempt(lambda: registry_entry(PATCH))
    reason = "torchvision missing here (Qwen3VLVideoProcessor needs it; the GPU machine has it)"
    res["processor"] = attempt(processor) if has_tv else {"skipped": reason}
    res["profiling_inputs"] = attempt(profiling_inputs) if has_tv else {"skipped": reason}
    d, s = res["engine"]["dualgpu"], res["engine"]["stock"]
    checks = {
        "model files load, vision token ids in vocab": res["files"].get("ids_match_config") is True
        and res["files"].get("ids_in_vocab") is True,
        "qwen3.5 multimodal hybrid with M-RoPE": d.get("model_class") == "Qwen3_5ForConditionalGeneration"
        and d.get("is_multimodal") is True and d.get("is_hybrid") is True and d.get("uses_mrope") is True,
        "dualgpu config, pp=2, preflight accepts": d.get("executor") == "DualGpuExecutor" and d.get("pp") == 2
        and d.get("is_dualgpu_pp") is True and "error" not in d,
        "stock (mp) config builds": s.get("executor") == "mp" and s.get("pp") == 2,
        "images enabled (stock builds the tower on every rank)": d.get("image_limit", 0) > 0,
        "V2 runner not blocked": d.get("v2_runner_blockers") == [] and s.get("v2_runner_blockers") == [],
        "patch entry targets vLLM's _mark_tower_model": res["patch"].get("target_exists") is True,
    }
    if has_tv:
        checks["HF processor loads"] = res["processor"].get("image_token_id") == cfg_json["image_token_id"]
        checks["profiling inputs build"] = (res["profiling_inputs"].get("items") or 0) > 0
    res["checks"], res["ok"] = checks, all(checks.values())
    (out / "vision_pp.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, default=str))
    return 0 if res["ok"] else 1


# --- child: vLLM itself ------------------------------------------------------------------------


def probe_worker(worker) -> dict:
    """Runs inside each worker (collective_rpc): where the vision weights are."""
    import torch
    from vllm.distributed.parallel_state import get_pp_group

    runner, prefix = worker.model_runner, VISION_ATTR + "."
    model = runner.model
    visual = getattr(model, VISION_ATTR, None)
    params = list(model.named_parameters())
    vision = [p for n, p in params if n.startswith(prefix)]
    inner = getattr(visual, "__dict__", {}).get("module")  # StageMissingLayer keeps it, on meta
    return {
        "pp_rank": get_pp_group().rank_in_group, "pid": os.getpid(), "cuda_device": torch.cuda.current_device(),
        "runner": type(runner).__name__, "use_v2_model_runner": bool(worker.vllm_config.use_v2_model_runner),
        "model_class": type(model).__name__,
        "visual_class": type(visual).__module__ + "." + type(visual).__name__ if visual is not None else None,
        "visual_stage_name": getattr(visual, "stage_name", None) if type(visual).__name__ == "StageMissingLayer" else None,
        "placeholder_module_devices": sorted({str(p.device) for p in inner.parameters()}) if inner is not None else None,
        "tower_model_names": list(getattr(model, "_tower_model_names", []) or []),
        "vision_params": len(vision), "vision_bytes": sum(p.numel() * p.element_size() for p in vision),
        "total_param_bytes": sum(p.numel() * p.element_size() for _, p in params),
        "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
        "runner_supports_mm_inputs": getattr(runner, "supports_mm_inputs", None),
        "has_encoder_cache": getattr(runner, "encoder_cache", None) is not None,
    }


def child(out: Path, model: Path, arm: str) -> int:
    t0, res = time.time(), {"arm": arm}
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs(model, arm))
        res["boot_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
        res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        res["workers"] = llm.collective_rpc(probe_worker, timeout=60)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    write_child_result(out, arm, res, t0)
    return 0


# --- parent: process groups, log lines, checks -------------------------------------------------

def run_arm(out: Path, model: Path, arm: str, timeout: float) -> dict:
    res: dict = {"engine_kwargs": {**engine_kwargs(model, arm), "model": "OUTDIR/model"},
                 "time_limit_s": round(timeout, 1), "log": f"{arm}-llm.log"}
    res.update(run_child(Path(__file__).resolve(), out, arm, timeout,
                         env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}))  # collective_rpc with a function
    return res


def checks(res: dict) -> dict:
    c, w = res.get("child") or {}, workers_by_rank(res)
    lines = [l for l in res.get("plugin_lines", []) if re.search(r"\(worker[,+ ]", l)]
    return {
        "booted and generated": "error" not in c and len(c.get("outputs") or []) == len(prompts()),
        "two ranks probed on the V2 runner": sorted(w) == [0, 1] and all(x["use_v2_model_runner"] for x in w.values()),
        "rank 0 holds vision weights": w.get(0, {}).get("vision_bytes", 0) > 0,
        "rank 1 holds no vision weights": 1 in w and w[1]["vision_bytes"] == 0 and w[1]["vision_params"] == 0,
        f"workers applied {PATCH}": len(lines) >= 2 and all(PATCH in applied_names(l) for l in lines),
    }


def summary_of(res: dict) -> dict:
    w = workers_by_rank(res)
    return {"wall_s": res.get("wall_s"), "timed_out": res.get("timed_out"),
            "error": (res.get("child") or {}).get("error", None if res.get("child") else "no result"),
            "vision_bytes": {r: x["vision_bytes"] for r, x in sorted(w.items())},
            "visual_class": {r: x["visual_class"].rsplit(".", 1)[-1] for r, x in sorted(w.items()) if x["visual_class"]},
            "allocated_gib": {r: round(x["allocated"] / 1024**3, 3) for r, x in sorted(w.items())}}


def parent(out: Path, model: Path, timeout: float) -> int:
    kill_running_on_exit()
    deadline = time.time() + timeout
    dual = run_arm(out, model, "dualgpu", max(deadline - time.time() - STOCK_MIN_S, 10.0))
    stock = run_arm(out, model, "stock", max(deadline - time.time(), 10.0))
    dual["checks"] = checks(dual)
    sw = workers_by_rank(stock)
    stock["info"] = {"booted": bool(sw), "rank1_vision_bytes": sw.get(1, {}).get("vision_bytes"),
                     "rank1_holds_vision_weights": sw[1]["vision_bytes"] > 0 if 1 in sw else None}
    result = {"mode": "gpu", "patch": PATCH, "dualgpu": dual, "stock": stock, "checks": dual["checks"],
              "ok": all(dual["checks"].values())}
    (out / "vision_pp.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"ok": result["ok"], "checks": result["checks"], "dualgpu": summary_of(dual),
                      "stock": {**summary_of(stock), **stock["info"]}}))
    return 0 if result["ok"] else 1


def main() -> int:
    return arms_main(__doc__, ARMS, timeout=200.0, dry_help="CPU only: model files, engine configs, processor",
                     prepare=write_model, reuse=lambda out: out / "model",
                     dry_run=dry_run, child=child, parent=parent)


if __name__ == "__main__":
    raise SystemExit(main())
