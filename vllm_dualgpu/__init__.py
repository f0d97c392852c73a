"""vllm-dualgpu: serve one model on two mismatched NVIDIA GPUs with stock vLLM.

Importing this package is cheap on purpose: vLLM imports it in every process through the
``vllm.general_plugins`` entry point, so nothing heavy happens until :func:`register` runs.
"""

from vllm_dualgpu._version import SUPPORTED_VLLM, __version__

__all__ = ["SUPPORTED_VLLM", "__version__", "register"]


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (runs once in every vLLM process)."""
    from vllm_dualgpu.plugin import register as _register

    _register()
