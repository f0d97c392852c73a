__version__ = "0.1.0"

# vLLM releases this version of the package was written and tested against (0.30.0 to 0.34.0).
# Each patch carries the part of this range it was checked for (see docs/patches.md).
SUPPORTED_VLLM = ">=0.30.0,<0.35"
# Every other release (pre-releases outside the range included): there the plugin only refuses
# the dualgpu backend (registry entry dualgpu-needs-supported-vllm). "not" is read by
# vllm_dualgpu.support.version_in_range.
UNSUPPORTED_VLLM = "not " + SUPPORTED_VLLM
