"""Two tool-calling fixes for vLLM's Qwen3 XML tool parser (``--tool-call-parser qwen3_xml``,
also ``qwen3_coder``), carried from the reference setup; see docs/tool-calling.md.

Both parser names resolve to ``Qwen3EngineToolParser``, an adapter over ``vllm.parser.qwen3``'s
``Qwen3Parser`` (a ``ParserEngine``). The model writes a call as::

    <tool_call>
    <function=write>
    <parameter=path>
    README.md
    </parameter>
    <parameter=content>
    ...
    </parameter>
    </function>
    </tool_call>

1. Cut arguments come back closed (:func:`wrap_flush_arg_converter`). While streaming, the
   engine sends a string value as it grows, leaving its closing quote for the flush at the end of
   the call (``ParserEngine._flush_arg_converter``). The flush re-derives the arguments with
   ``partial=False``, which drops a parameter still open (generation cut by ``max_tokens``, a
   stop string, or a model that never wrote ``</parameter>``): the result is no longer an
   extension of what the client holds, the flush sends nothing and the client is left with
   ``{"path": "README.md", "content": "# Title...`` (vLLM PR #53739). The wrapper keeps vLLM's
   flush and, only when it sends nothing while the streamed text is not valid JSON, sends the
   rest of the partial conversion (the open value as generated, closed), or failing that the
   closing quote and brackets of what was streamed.
2. ``<parameter=...>`` text inside a value stays in the value (:func:`qwen3_arg_converter`).
   vLLM's ``_qwen3_arg_converter`` ends a value at ``</parameter>`` or at the next
   ``<parameter=``, so a value that mentions the tag (a file about this very format, a prompt
   template) is split and the text after it becomes a phantom argument. Here a value ends only at
   a ``</parameter>`` followed by the next ``<parameter=``, ``</function>``, ``</tool_call>`` or
   the end of the arguments; in a streamed, partial conversion a closer followed by the start of
   one of those counts too, so streamed prefixes stay prefixes. Otherwise the conversion is
   vLLM's (names, one wrapping newline trimmed, ``json.dumps(..., ensure_ascii=False)``). The
   cost: a model that omits ``</parameter>`` before the next ``<parameter=`` gets the rest in
   that value (vLLM guesses a new parameter there).
   On vLLM 0.33 and 0.34 a fast path streams an open value without re-converting
   (``_qwen3_arg_value_extender``); it finds the open value with vLLM's rule, so
   :func:`wrap_qwen3_arg_value_extender` hands it out only where both rules agree on the open
   parameter and its text (elsewhere the engine converts every delta, as it does on 0.30-0.32).
   vLLM 0.34 gives both functions a ``closed`` argument, a per-parser cache of the parameters
   closed so far by vLLM's rule (``_ClosedParams``, filled by ``_qwen3_parse_params``), and
   ``Qwen3Parser.__init__`` binds one to both when its converter is the module's
   ``_qwen3_arg_converter`` (the replacement, once patched). The replacement converter takes it
   and leaves it alone, re-reading the whole text as on 0.30-0.33, so the cache only ever holds
   vLLM's rule for vLLM's fast path and the agreement check that guards it.

``qwen3_config`` (``functools.cache``) looks both functions up when it builds a config, so the
factories clear its cache: configs built before the patch would keep vLLM's functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import regex as re

_OPEN = re.compile(r"<\s*parameter\s*=\s*([^>]*)>")
_CLOSE = re.compile(r"<\s*/\s*parameter\s*>")
# What may follow the closer that ends a value: the next parameter, the end of the function or
# of the call, or the end of the arguments (the engine keeps </function> out of them).
_AFTER_CLOSE = re.compile(r"\s*(?:<\s*parameter\s*=|<\s*/\s*function\s*>|<\s*/\s*tool_call\s*>|\Z)")


def _clear_config_cache() -> None:
    from vllm.parser import qwen3

    qwen3.qwen3_config.cache_clear()


# --- 2. <parameter=...> text inside a value ---------------------------------------------------


def _trim_wrapping_newlines(value: str) -> str:
    """vLLM's ``_trim_wrapping_newlines``: one leading and one trailing newline are markup."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _value_end(raw: str, start: int, partial: bool) -> tuple[int, int] | None:
    """(start, end) of the closer ending the value that starts at ``start``; None while open."""
    for close in _CLOSE.finditer(raw, start):
        if _AFTER_CLOSE.match(raw, close.end()):
            return close.start(), close.end()
        if partial and _AFTER_CLOSE.fullmatch(raw, close.end(), partial=True):
            return close.start(), close.end()
    return None


def parse_params(raw_args: str, partial: bool) -> tuple[dict[str, str], tuple[str, str] | None]:
    """The closed parameters of ``raw_args`` and, with ``partial``, the open one (name, raw
    value), by this module's rule."""
    params: dict[str, str] = {}
    pos = 0
    while (opener := _OPEN.search(raw_args, pos)) is not None:
        name = opener.group(1)
        end = _value_end(raw_args, opener.end(), partial)
        if end is None:
            if partial and name:
                return params, (name, raw_args[opener.end():])
            break
        params[name] = _trim_wrapping_newlines(raw_args[opener.end():end[0]])
        pos = end[1]
    return params, None


def qwen3_arg_converter(raw_args: str, partial: bool) -> str:
    """``_qwen3_arg_converter`` with a value ending only at a closer followed by structure."""
    params, open_param = parse_params(raw_args, partial)
    if open_param is not None:
        params[open_param[0]] = _trim_wrapping_newlines(open_param[1])
    return json.dumps(params, ensure_ascii=False)


def wrap_qwen3_arg_converter(original: Callable[[str, bool], str]) -> Callable[[str, bool], str]:
    """Factory: the converter above (mirrors vLLM's source; the registry pins it)."""
    _clear_config_cache()

    def _qwen3_arg_converter(raw_args: str, partial: bool) -> str:
        return qwen3_arg_converter(raw_args, partial)

    return _qwen3_arg_converter


def wrap_qwen3_arg_converter_034(original: Callable) -> Callable:
    """Factory (vLLM 0.34): the converter above with 0.34's ``closed`` cache accepted and unused
    (it holds vLLM's rule)."""
    _clear_config_cache()

    def _qwen3_arg_converter(raw_args: str, partial: bool, closed=None) -> str:
        return qwen3_arg_converter(raw_args, partial)

    return _qwen3_arg_converter


def _same_open_param(stock, raw_args: str) -> bool:
    """Whether vLLM's match of the open parameter (or None) has the name and text that this
    module's rule finds open."""
    found = None if stock is None else (stock.group(1), stock.group(2))
    return found == parse_params(raw_args, True)[1]


def wrap_qwen3_arg_value_extender(original: Callable) -> Callable:
    """Factory (vLLM 0.33): vLLM's fast path only where it streams the value the converter
    above sees open."""
    _clear_config_cache()
    from vllm.parser import qwen3

    def _qwen3_arg_value_extender(raw_args: str):
        stock = qwen3._PARTIAL_PARAM_RE.search(qwen3._PARAM_RE.sub("", raw_args))
        if not _same_open_param(stock, raw_args):
            return None
        return original(raw_args)

    return _qwen3_arg_value_extender


def wrap_qwen3_arg_value_extender_034(original: Callable) -> Callable:
    """Factory (vLLM 0.34): the same, vLLM's open parameter read through its cache."""
    _clear_config_cache()
    from vllm.parser import qwen3

    def _qwen3_arg_value_extender(raw_args: str, closed=None):
        if not _same_open_param(qwen3._qwen3_parse_params(raw_args, True, closed)[1], raw_args):
            return None
        return original(raw_args, closed=closed)

    return _qwen3_arg_value_extender


# --- 1. cut arguments come back closed --------------------------------------------------------


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def close_json(prefix: str) -> str | None:
    """``prefix`` (a JSON text cut inside its last value) with its string and containers closed;
    None when no closing makes it valid JSON."""
    stack: list[str] = []
    in_string = escape = False
    last = ""
    for c in prefix:
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
        if not c.isspace():
            last = c
    if escape:
        return None
    tail = '"' if in_string else ("null" if last == ":" else "")
    closed = prefix + tail + "".join(reversed(stack))
    return closed if _is_json(closed) else None


def _partial_args(engine, slot) -> str | None:
    """The arguments as the streaming path converts them (open value included), types fixed."""
    try:
        text = engine._arg_converter(slot.args, True)
    except (ValueError, TypeError):
        return None
    if text and slot.name:
        text = engine._fix_arg_types(text, slot.name)
    return text or None


def wrap_flush_arg_converter(original: Callable) -> Callable:
    """Factory: vLLM's flush, then close what was streamed when the flush cannot extend it."""

    def _flush_arg_converter(self, idx: int) -> str | None:
        diff = original(self, idx)
        if diff is not None or self._arg_converter is None:
            return diff
        slot = self._tool_slots[idx]
        prev = slot.streamed_json
        if not prev or _is_json(prev):
            return diff
        closed = _partial_args(self, slot)
        if closed is None or not closed.startswith(prev) or not _is_json(closed):
            closed = close_json(prev)
        if closed is None:
            return diff
        slot.streamed_json = closed
        return closed[len(prev):]

    return _flush_arg_converter
