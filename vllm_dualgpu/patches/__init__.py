"""Run-time patches of vLLM, declared in :mod:`vllm_dualgpu.patching.registry`."""
