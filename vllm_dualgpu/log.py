"""The package logs through a child of vLLM's own logger, so lines carry vLLM's format."""

import logging

logger = logging.getLogger("vllm.dualgpu")
