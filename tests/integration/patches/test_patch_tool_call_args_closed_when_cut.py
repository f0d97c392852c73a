"""tool-call-args-closed-when-cut: streamed arguments cut mid-value come back as valid JSON,
on vLLM's real qwen3_xml parser (vLLM PR #53739)."""

from __future__ import annotations

import json

import pytest
from qwen3_xml_parser import (  # noqa: F401  (fixtures)
    CHUNKS,
    applied,
    call,
    extracted,
    request_with_tools,
    reverted,
    streamed,
    tokenizer,
)

NAME = "tool-call-args-closed-when-cut"
CUT = call(("path", "README.md"), ("content", "# Title\n\nbody text that stops mid-sen"), closed=False)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_cut_mid_value_comes_back_closed(tokenizer, request_with_tools, chunk):
    with applied(NAME):
        args = streamed(tokenizer, request_with_tools, CUT, chunk)
    assert args == '{"path": "README.md", "content": "# Title\\n\\nbody text that stops mid-sen"}'
    assert json.loads(args)["content"] == "# Title\n\nbody text that stops mid-sen"


def test_without_the_patch_the_client_holds_unterminated_json(tokenizer, request_with_tools):
    with reverted(NAME):
        args = streamed(tokenizer, request_with_tools, CUT, 1)
    assert args == '{"path": "README.md", "content": "# Title\\n\\nbody text that stops mid-sen'
    with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        json.loads(args)


@pytest.mark.parametrize("chunk", (1, 7, 10_000))
def test_a_value_the_model_never_closed_is_kept_and_closed(tokenizer, request_with_tools, chunk):
    """vLLM issue #57699's shape: </function> right after the last value, no </parameter>."""
    text = "<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n" \
           "<parameter=content>\nhello\n</function>\n</tool_call>"
    with applied(NAME):
        assert streamed(tokenizer, request_with_tools, text, chunk) == '{"path": "a.txt", "content": "hello"}'
    with reverted(NAME):
        assert streamed(tokenizer, request_with_tools, text, chunk) == '{"path": "a.txt", "content": "hello'


@pytest.mark.parametrize("chunk", (1, 4, 10_000))
def test_a_complete_call_streams_as_vllm_streams_it(tokenizer, request_with_tools, chunk):
    text = call(("path", "a.txt"), ("mode", "3"), ("content", "line1\nline2"))
    want = '{"path": "a.txt", "mode": 3, "content": "line1\\nline2"}'
    with applied(NAME):
        assert streamed(tokenizer, request_with_tools, text, chunk) == want
    with reverted(NAME):
        assert streamed(tokenizer, request_with_tools, text, chunk) == want


def test_non_streaming_results_are_unchanged(tokenizer, request_with_tools):
    with applied(NAME):
        patched = extracted(tokenizer, request_with_tools, CUT)
    with reverted(NAME):
        stock = extracted(tokenizer, request_with_tools, CUT)
    assert patched == stock == '{"path": "README.md"}'


def test_close_json_closes_strings_and_containers():
    from vllm_dualgpu.patches.tool_parsers_qwen3_xml import close_json

    assert close_json('{"a": [1, {"b": "x\\"y') == '{"a": [1, {"b": "x\\"y"}]}'
    assert close_json('{"a": "x", "b": ') == '{"a": "x", "b": null}'
    assert close_json('{"a": "x\\') is None  # cut inside an escape: no closing makes it JSON
    assert close_json('{"a": "x",') is None


def test_the_opt_out_leaves_vllms_flush(monkeypatch, tokenizer, request_with_tools):
    from vllm.parser.engine.parser_engine import ParserEngine

    from vllm_dualgpu import plugin
    from vllm_dualgpu.envs import TOOL_PARSER_FIXES
    from vllm_dualgpu.process import FRONTEND

    assert NAME in [p.name for p in plugin.select_patches(frozenset({FRONTEND}), active=False)]
    monkeypatch.setenv(TOOL_PARSER_FIXES, "0")
    with reverted(NAME):
        stock = ParserEngine._flush_arg_converter
        for p in plugin.select_patches(frozenset({FRONTEND}), active=False):
            assert p.opt_out != TOOL_PARSER_FIXES, p.name
        assert ParserEngine._flush_arg_converter is stock
        with pytest.raises(json.JSONDecodeError):
            json.loads(streamed(tokenizer, request_with_tools, CUT, 3))


def test_the_pinned_source_is_the_installed_one():
    import vllm

    from vllm_dualgpu.patching.core import ALREADY, READY, check_patch
    from vllm_dualgpu.patching.registry import PATCHES

    (patch,) = [p for p in PATCHES if p.name == NAME]
    with reverted(NAME):
        assert check_patch(patch, vllm.__version__).status in (READY, ALREADY)
