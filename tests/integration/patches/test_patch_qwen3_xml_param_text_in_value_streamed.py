"""qwen3-xml-param-text-in-value-streamed (vLLM 0.33, and its -034 entry): the streaming fast
path for open Qwen3 XML values streams what qwen3-xml-param-text-in-value converts, on vLLM's real
qwen3_xml parser. The entries are the ones of the installed vLLM's release."""

from __future__ import annotations

import pytest
import vllm
from qwen3_xml_parser import (  # noqa: F401  (fixtures)
    applied,
    call,
    extracted,
    request_with_tools,
    reverted,
    streamed,
    streamed_calls,
    tokenizer,
)

from vllm_dualgpu.patching.core import version_in_range
from vllm_dualgpu.patching.registry import for_version

FAMILY = "qwen3-xml-param-text-in-value-streamed"
CONVERTER = for_version("qwen3-xml-param-text-in-value", vllm.__version__).name

HAS_FAST_PATH = version_in_range(vllm.__version__, ">=0.33.0")
NAME = for_version(FAMILY, vllm.__version__).name if HAS_FAST_PATH else None
needs_fast_path = pytest.mark.skipif(
    not HAS_FAST_PATH,
    reason=f"vLLM {vllm.__version__} has no streaming fast path (_qwen3_arg_value_extender)",
)

# Tag text right before a value's newline: the fast path, finding the open value with vLLM's
# rule, takes '<parameter=x>' for the opener of a fresh value and drops that newline.
TEXTS = {
    "mention then more": (
        call(("content", "Use <parameter=x>\nfoo\nbar"), ("path", "a")),
        '{"content": "Use <parameter=x>\\nfoo\\nbar", "path": "a"}',
    ),
    "tag first": (
        call(("content", "<parameter=x>\nfoo")),
        '{"content": "<parameter=x>\\nfoo"}',
    ),
    "closer inside": (
        call(("content", "Use <parameter=x>\n\nfoo</parameter> bar")),
        '{"content": "Use <parameter=x>\\n\\nfoo</parameter> bar"}',
    ),
}


@needs_fast_path
@pytest.mark.parametrize("case", TEXTS)
@pytest.mark.parametrize("chunk", (1, 2, 3, 5, 8, 13, 10_000))
def test_streamed_arguments_match_the_converted_ones(tokenizer, request_with_tools, case, chunk):
    text, want = TEXTS[case]
    with applied(CONVERTER, NAME):
        assert extracted(tokenizer, request_with_tools, text) == want
        assert streamed(tokenizer, request_with_tools, text, chunk) == want


@needs_fast_path
@pytest.mark.parametrize("case", TEXTS)
def test_without_the_patch_the_fast_path_loses_text(tokenizer, request_with_tools, case):
    text, want = TEXTS[case]
    with applied(CONVERTER), reverted(NAME):
        assert extracted(tokenizer, request_with_tools, text) == want
        got = streamed(tokenizer, request_with_tools, text, 1)
    assert got != want
    assert got.startswith(want.split("\\n")[0])  # the text up to the dropped newline


@needs_fast_path
@pytest.mark.parametrize("chunk", (1, 3, 7, 10_000))
def test_calls_streamed_by_one_parser_stay_apart(tokenizer, request_with_tools, chunk):
    """One parser streams every call of a response (and vLLM 0.34 keeps parsed parameters per
    parser): tag text in a value stays there in each call."""
    first, want_first = TEXTS["mention then more"]
    second = call(("path", "a"), ("content", "x <parameter=path>\nb"))
    want_second = '{"path": "a", "content": "x <parameter=path>\\nb"}'
    with applied(CONVERTER, NAME):
        got = streamed_calls(tokenizer, request_with_tools, first + "\n" + second, chunk)
    assert got == [want_first, want_second]


@needs_fast_path
def test_ordinary_values_keep_vllms_fast_path(tokenizer, request_with_tools, monkeypatch):
    """Where both rules agree the wrapper returns vLLM's extender (counted here)."""
    from vllm.parser import qwen3

    made = []
    stock = qwen3._param_value_extender

    def counting(*args, **kwargs):
        ext = stock(*args, **kwargs)
        made.append(ext is not None)
        return ext

    monkeypatch.setattr(qwen3, "_param_value_extender", counting)
    text = call(("path", "a.txt"), ("content", "line1\nline2\nline3"))
    with applied(CONVERTER, NAME):
        assert streamed(tokenizer, request_with_tools, text, 1) == (
            '{"path": "a.txt", "content": "line1\\nline2\\nline3"}'
        )
    assert any(made)


@needs_fast_path
def test_the_opt_out_leaves_vllms_fast_path(monkeypatch):
    from vllm.parser import qwen3

    from vllm_dualgpu import plugin
    from vllm_dualgpu.envs import TOOL_PARSER_FIXES
    from vllm_dualgpu.process import FRONTEND

    assert NAME in [p.name for p in plugin.select_patches(frozenset({FRONTEND}), active=False)]
    monkeypatch.setenv(TOOL_PARSER_FIXES, "0")
    with reverted(NAME):
        stock = qwen3._qwen3_arg_value_extender
        assert NAME not in [p.name for p in plugin.select_patches(frozenset({FRONTEND}), active=False)]
        assert qwen3._qwen3_arg_value_extender is stock


@needs_fast_path
def test_the_pinned_source_is_the_installed_one():
    from vllm_dualgpu.patching.core import READY, check_patch
    from vllm_dualgpu.patching.registry import PATCHES

    (patch,) = [p for p in PATCHES if p.name == NAME]
    with reverted(NAME):
        assert check_patch(patch, vllm.__version__).status == READY


@pytest.mark.skipif(HAS_FAST_PATH, reason="this vLLM has the fast path")
def test_older_vllm_skips_the_entries():
    from vllm_dualgpu.patching.core import SKIPPED, check_patch
    from vllm_dualgpu.patching.registry import PATCHES, family

    assert for_version(FAMILY, vllm.__version__) is None
    entries = [p for p in PATCHES if family(p.name) == FAMILY]
    assert entries
    for p in entries:
        outcome = check_patch(p, vllm.__version__)
        assert outcome.status == SKIPPED and f"vLLM {vllm.__version__} not in" in outcome.reason


@needs_fast_path
def test_one_entry_per_release():
    from vllm_dualgpu.patching.core import SKIPPED, check_patch
    from vllm_dualgpu.patching.registry import PATCHES, family

    others = [p for p in PATCHES if family(p.name) == FAMILY and p.name != NAME]
    assert others
    for p in others:
        assert check_patch(p, vllm.__version__).status == SKIPPED, p.name
