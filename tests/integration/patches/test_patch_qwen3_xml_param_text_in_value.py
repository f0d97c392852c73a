"""qwen3-xml-param-text-in-value (and its -034 entry): '<parameter=...>' text inside an argument
value stays in the value, on vLLM's real qwen3_xml parser, streamed and not. The entries are the
ones of the installed vLLM's release."""

from __future__ import annotations

import pytest
import vllm
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

from vllm_dualgpu.patching.registry import for_version

FAMILY = "qwen3-xml-param-text-in-value"
NAME = for_version(FAMILY, vllm.__version__).name
# vLLM 0.33+ streams open values through a fast path that its own entry keeps consistent.
_FAST_PATH = for_version(f"{FAMILY}-streamed", vllm.__version__)
STREAMED = (_FAST_PATH.name,) if _FAST_PATH else ()
MENTION = call(("path", "notes.md"), ("content", "Use <parameter=x> to start a parameter."))
NESTED = call(("content", "Write <parameter=x>\ny\n</parameter> for x."), ("path", "a.md"))


def test_tag_text_stays_in_the_value(tokenizer, request_with_tools):
    with applied(NAME):
        assert extracted(tokenizer, request_with_tools, MENTION) == (
            '{"path": "notes.md", "content": "Use <parameter=x> to start a parameter."}'
        )
        assert extracted(tokenizer, request_with_tools, NESTED) == (
            '{"content": "Write <parameter=x>\\ny\\n</parameter> for x.", "path": "a.md"}'
        )


@pytest.mark.parametrize("chunk", CHUNKS)
def test_streamed_arguments_match(tokenizer, request_with_tools, chunk):
    with applied(NAME, *STREAMED):
        assert streamed(tokenizer, request_with_tools, MENTION, chunk) == (
            '{"path": "notes.md", "content": "Use <parameter=x> to start a parameter."}'
        )
        assert streamed(tokenizer, request_with_tools, NESTED, chunk) == (
            '{"content": "Write <parameter=x>\\ny\\n</parameter> for x.", "path": "a.md"}'
        )


def test_without_the_patch_the_text_becomes_a_phantom_argument(tokenizer, request_with_tools):
    with reverted(NAME, *STREAMED):
        assert extracted(tokenizer, request_with_tools, MENTION) == (
            '{"path": "notes.md", "content": "Use ", "x": " to start a parameter."}'
        )
        assert streamed(tokenizer, request_with_tools, MENTION, 3) == (
            '{"path": "notes.md", "content": "Use ", "x": " to start a parameter."}'
        )


@pytest.mark.parametrize("chunk", (1, 3, 10_000))
def test_ordinary_calls_convert_as_vllm_converts_them(tokenizer, request_with_tools, chunk):
    text = call(("path", "a.txt"), ("mode", "3"), ("content", "\nline1\nline2\n"))
    want = '{"path": "a.txt", "mode": 3, "content": "\\nline1\\nline2\\n"}'
    with applied(NAME, *STREAMED):
        assert extracted(tokenizer, request_with_tools, text) == want
        assert streamed(tokenizer, request_with_tools, text, chunk) == want
    with reverted(NAME, *STREAMED):
        assert extracted(tokenizer, request_with_tools, text) == want
        assert streamed(tokenizer, request_with_tools, text, chunk) == want


def test_partial_conversion_ends_a_value_at_a_closer_that_may_start_structure():
    from vllm_dualgpu.patches.tool_parsers_qwen3_xml import qwen3_arg_converter

    raw = "\n<parameter=a>\nx\n</parameter>\n<par"
    assert qwen3_arg_converter(raw, True) == '{"a": "x"}'
    assert qwen3_arg_converter(raw + "ameter=b>\ny", True) == '{"a": "x", "b": "y"}'
    assert qwen3_arg_converter("\n<parameter=a>\nx\n</parameter> and", True) == (
        '{"a": "x\\n</parameter> and"}'
    )
    assert qwen3_arg_converter("\n<parameter=a>\nx and", False) == "{}"  # open: dropped, as vLLM


def test_configs_built_before_the_patch_get_it(tokenizer, request_with_tools):
    """qwen3_config caches the configs that hold the converter; the factory clears the cache."""
    from qwen3_xml_parser import parser_class

    with reverted(NAME):
        parser_class()(tokenizer, request_with_tools.tools)  # caches a config with vLLM's
        with applied(NAME):
            assert '"x"' not in extracted(tokenizer, request_with_tools, MENTION)


def test_the_opt_out_leaves_vllms_converter(monkeypatch, tokenizer, request_with_tools):
    from vllm.parser import qwen3

    from vllm_dualgpu import plugin
    from vllm_dualgpu.envs import TOOL_PARSER_FIXES
    from vllm_dualgpu.process import FRONTEND

    assert NAME in [p.name for p in plugin.select_patches(frozenset({FRONTEND}), active=False)]
    for off in ("0", "off"):
        monkeypatch.setenv(TOOL_PARSER_FIXES, off)
        with reverted(NAME, *STREAMED):
            stock = qwen3._qwen3_arg_converter
            for p in plugin.select_patches(frozenset({FRONTEND}), active=False):
                assert p.opt_out != TOOL_PARSER_FIXES, p.name
            assert qwen3._qwen3_arg_converter is stock
            assert '"x": " to start' in extracted(tokenizer, request_with_tools, MENTION)


def test_the_pinned_source_is_the_installed_one():
    from vllm_dualgpu.patching.core import READY, check_patch
    from vllm_dualgpu.patching.registry import PATCHES

    (patch,) = [p for p in PATCHES if p.name == NAME]
    with reverted(NAME):
        assert check_patch(patch, vllm.__version__).status == READY


def test_one_entry_per_release():
    """Each release gets the entry written against its source; the others skip there."""
    from vllm_dualgpu.patching.core import SKIPPED, check_patch
    from vllm_dualgpu.patching.registry import PATCHES, family

    others = [p for p in PATCHES if family(p.name) == FAMILY and p.name != NAME]
    assert others
    for p in others:
        assert check_patch(p, vllm.__version__).status == SKIPPED, p.name
