"""Which vLLM releases this package supports, and the one message for any other.

The CLI (``plan``, ``doctor``), the plugin and the ``dualgpu`` backend all ask here, so they say
the same thing. Reads the installed version from package metadata: vLLM is not imported.
"""

from __future__ import annotations

import importlib.metadata

from vllm_dualgpu._version import SUPPORTED_VLLM, __version__

#: The releases each range end of the registry was checked against (oldest first).
CHECKED_RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, or None when vLLM is not installed."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


#: A range written ``not <specifier>`` holds every version the specifier leaves out.
NOT = "not "


def version_in_range(version: str, spec: str) -> bool:
    """Whether ``version`` matches the PEP 440 specifier ``spec``, any of ``A || B``, or (spec
    ``not S``) is left out by ``S``.

    Pre-releases, development builds, post-releases and local builds are matched as the
    versions they are (``0.33.1.dev12+g0123abc`` is in ``<0.34``; ``0.34.0rc1`` and
    ``0.30.0rc2`` are not in ``>=0.30.0,<0.34``), never left out of both a range and its
    ``not``.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if spec.startswith(NOT):
        return not version_in_range(version, spec[len(NOT):])
    v = Version(version)
    return any(SpecifierSet(part.strip()).contains(v, prereleases=True) for part in spec.split("||"))


def is_supported(version: str) -> bool:
    return version_in_range(version, SUPPORTED_VLLM)


def unsupported_reason(version: str | None = None) -> str | None:
    """None when the installed (or given) vLLM is supported, else one line saying what to do."""
    version = installed_vllm_version() if version is None else version
    if version is None:
        return (f"vLLM is not installed; vllm-dualgpu {__version__} needs vLLM {SUPPORTED_VLLM}: "
                f"pip install 'vllm{SUPPORTED_VLLM}'")
    if is_supported(version):
        return None
    return (f"vllm-dualgpu {__version__} supports vLLM {SUPPORTED_VLLM}, found {version}: "
            f"pip install 'vllm{SUPPORTED_VLLM}' (the newest supported is {CHECKED_RELEASES[-1]}), "
            "or run without --distributed-executor-backend dualgpu")
