__version__ = "0.1.0"

# vLLM releases this version of the package was written and tested against.
# Later releases get their own, version-ranged patches (see docs/patches.md).
SUPPORTED_VLLM = ">=0.30.0,<0.31"
