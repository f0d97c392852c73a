"""Findings of :mod:`vllm_dualgpu.patching.static_check` that are false alarms, each with why.

Keyed by (the entry's target, the copy-holding module or the overriding ``module:Class``); the
value says why the copy left unrebound or the override left unpatched changes nothing for a
dualgpu run. A real gap is fixed in the entry (a ``copies`` holder, another patch), not here.
"""

from __future__ import annotations

ALLOWED: dict[tuple[str, str], str] = {
}
