"""The package logs through a child of vLLM's own logger, so lines carry vLLM's format."""

import logging

logger = logging.getLogger("vllm.dualgpu")


def ensure_vllm_logging() -> None:
    """Give vLLM's logger its handler if vLLM has not yet (vLLM 0.33 configures logging only
    when a CLI or engine starts, after plugins load: an INFO line before then is dropped, since
    Python prints only warnings without a handler). Applies vLLM's own bootstrap configuration,
    what vLLM 0.30-0.32 do when ``vllm.logger`` is imported; vLLM's later configuration
    replaces it. Declared as the intervention ``vllm-logging-bootstrap``."""
    if logging.getLogger("vllm").handlers:
        return
    try:
        from vllm.logger import _configure_vllm_root_logger
    except ImportError:  # vLLM absent (the pure CLI): nothing to configure
        return
    _configure_vllm_root_logger()
