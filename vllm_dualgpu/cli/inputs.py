"""What ``plan`` and ``plan --fleet`` (cli/topology.py) both read: a model's config.json and the
reserves the executor would keep on each card. Below both commands, so neither imports the other
for it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path


REFERENCE_PLACEHOLDER = "MODEL"
"""What the serve line of a plan of the bundled reference shows in place of a model."""


class UsageError(Exception):
    """A usage problem: print the message and exit 2."""


def read_config(model: str) -> tuple[dict, str]:
    path = Path(model).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
    elif path.is_file():
        cfg = path
    else:
        cfg = None
        if re.fullmatch(r"[\w.-]+/[\w.-]+", model):  # a Hub id: look in the local Hugging Face cache
            home = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
            snaps = sorted((home.expanduser() / f"models--{model.replace('/', '--')}" / "snapshots").glob("*/config.json"))
            if snaps:
                cfg = snaps[-1]
        if cfg is None:
            standin = (" (in the serve line of a plan of the bundled reference, MODEL stands for your "
                       "checkpoint's folder)" if model == REFERENCE_PLACEHOLDER else "")
            raise UsageError(
                f"cannot find {model!r}{standin}: give a local model directory with config.json (plan "
                "does not download anything)"
            )
    if not cfg.is_file():
        raise UsageError(f"{path} has no config.json")
    try:
        return json.loads(cfg.read_text()), str(cfg)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {cfg}: {e}") from None


def card_reserves(gpus, spec: str | None) -> list:
    """What each card keeps free and why (``envs.Reserve``): its ``--gpus`` entry's reserve=,
    else what the executor would keep there: VLLM_DUALGPU_RESERVE, else by the card's display
    (1 GiB with a display or where that is unknown, 256 MiB without: envs.card_reserves)."""
    from vllm_dualgpu import envs

    try:
        rules = envs.reserves(os.environ.get(envs.RESERVE), [g.display for g in gpus])
    except ValueError as e:
        raise UsageError(str(e)) from None
    entries = spec.split(",") if spec else [""] * len(gpus)
    return [envs.Reserve(g.reserve_bytes, GIVEN_RESERVE) if "reserve=" in entry else r
            for g, entry, r in zip(gpus, entries, rules)]


GIVEN_RESERVE = "--gpus reserve="
"""Why a card keeps its reserve when its ``--gpus`` entry names it."""


def with_default_reserves(gpus, spec: str | None, reserves: list | None = None):
    """GPUs whose --gpus entry names no reserve= get what the executor would keep free on them
    (:func:`card_reserves`; ``reserves``: its answer for these ``gpus`` and ``spec``, where the
    caller has it already)."""
    from dataclasses import replace

    reserves = card_reserves(gpus, spec) if reserves is None else reserves
    return [replace(g, reserve_bytes=r.bytes) for g, r in zip(gpus, reserves)]
