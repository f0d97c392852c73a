"""Facts a worker collects while it boots, logged as ONE summary line per rank.

Modules call :func:`note` as they learn something (the layer split, the KV pool, which tuned
config file was read, what the native hook rewrote); the worker logs :func:`line` once, after
its KV cache is allocated.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_facts: dict[str, str] = {}


def note(key: str, text: str) -> None:
    """Record (or replace) one fact for this process's summary line."""
    with _lock:
        _facts[key] = text


def add(key: str, item: str) -> None:
    """Append ``item`` to a fact that lists several ("a, b, c"), unless it lists it already."""
    with _lock:
        listed = _facts.get(key)
        if not listed:
            _facts[key] = item
        elif item not in listed.split(", "):
            _facts[key] = f"{listed}, {item}"


def facts() -> dict[str, str]:
    with _lock:
        return dict(_facts)


def line(prefix: str) -> str:
    with _lock:
        return prefix + "; ".join(f"{k}: {v}" for k, v in _facts.items())


def clear() -> None:
    with _lock:
        _facts.clear()
