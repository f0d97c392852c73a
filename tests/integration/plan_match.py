"""What the plan-vs-executor tests share: a sandbox for one model folder (the variables a plan
reads cleared, the executor's exports undone afterwards) and a handler collecting the package's
log messages."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

# what a plan reads from the environment, cleared for each test
PLAN_VARIABLES = ("VLLM_PP_LAYER_PARTITION", "VLLM_DUALGPU_RESERVE", "CUDA_VISIBLE_DEVICES",
                  "VLLM_DUALGPU_PLAN_FILE", "VLLM_DUALGPU_OBJECTIVE", "VLLM_DUALGPU_VIRTUAL_GPUS",
                  "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def sandbox(tmp_path: Path, monkeypatch, config: dict, sub: str = ""):
    """A fixture's body: the model folder (``tmp_path/sub`` with ``config`` as its config.json),
    then the environment as it was and the executor's exported split forgotten."""
    from vllm_dualgpu import envs

    for var in PLAN_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    folder = tmp_path / sub if sub else tmp_path
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    saved = dict(os.environ)
    yield folder
    os.environ.clear()
    os.environ.update(saved)
    envs.forget_exports()


def forget_the_split() -> None:
    """The executor exports its split, which the next plan would take as the user's."""
    from vllm_dualgpu.engine import partition

    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    partition.PARTITION.forget()


def executor_plan(model_dir, monkeypatch, serve: dict, seen: list):
    """The executor's plan on the CPU platform for the model in ``model_dir`` with vLLM serve's
    ``serve`` settings, NVML reporting ``seen``: (the config, the applied plan, its log messages)."""
    import vllm.platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform

    import vllm_dualgpu
    from vllm_dualgpu.engine import planning as apply
    from vllm_dualgpu.engine import preflight

    vllm.platforms._current_platform = CpuPlatform()
    vllm_dualgpu.register()
    monkeypatch.setattr(preflight, "nvml_gpu_count", lambda: len(seen))
    cfg = EngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                     pipeline_parallel_size=2, distributed_executor_backend="dualgpu", **serve).create_engine_config()
    cfg.parallel_config.worker_cls = apply.STOCK_WORKER
    monkeypatch.setattr(apply, "read_visible_gpus", lambda: seen)
    log = logging.getLogger("vllm.dualgpu")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        applied = apply.apply_plan(cfg)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return cfg, applied, handler.messages
