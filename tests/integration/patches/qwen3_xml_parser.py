"""vLLM's real qwen3_xml tool parser on a tokenizer built offline, and how a client sees it.

The parser needs a tokenizer only for its vocabulary and special tokens: a word-level tokenizer
of the Qwen3 chat markers (``tokenizers``, wrapped by ``transformers``) is enough, no download.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

WRITE_TOOL = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": "integer"},
            },
        },
    },
}


def call(*params: tuple[str, str], closed: bool = True) -> str:
    """Model output for write(...), each value on its own lines as Qwen3's template writes it;
    ``closed=False`` stops after the last value's text (generation cut mid-value)."""
    body = "".join(f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in params)
    text = f"<tool_call>\n<function=write>\n{body}"
    if not closed:
        return text[: -len("\n</parameter>\n")]
    return text + "</function>\n</tool_call>"


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", additional_special_tokens=SPECIALS
    )


@pytest.fixture(scope="session")
def request_with_tools():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=[WRITE_TOOL]
    )


def parser_class():
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser("qwen3_xml")


def extracted(tokenizer, request, text: str) -> str:
    """The arguments of the one tool call a non-streaming response returns."""
    parser = parser_class()(tokenizer, request.tools)
    (tool_call,) = parser.extract_tool_calls(text, request).tool_calls
    return tool_call.function.arguments


def _streamed_calls(tokenizer, request, text: str, chunk: int):
    """The tool-call deltas a streaming client receives when the text arrives ``chunk``
    characters at a time, including what the parser sends when the stream finishes."""
    parser = parser_class()(tokenizer, request.tools)
    previous = ""
    deltas = []
    for start in range(0, len(text), chunk):
        piece = text[start : start + chunk]
        deltas.append(
            parser.extract_tool_calls_streaming(
                previous, previous + piece, piece, [], [], [], request
            )
        )
        previous += piece
    deltas.append(parser.finish_streaming())
    for delta in deltas:
        for tc in (delta.tool_calls if delta else None) or []:
            if tc.function and tc.function.arguments:
                yield tc


def streamed(tokenizer, request, text: str, chunk: int) -> str:
    """The arguments a streaming client accumulates when the text arrives ``chunk`` characters
    at a time, including what the parser sends when the stream finishes."""
    return "".join(tc.function.arguments for tc in _streamed_calls(tokenizer, request, text, chunk))


def streamed_calls(tokenizer, request, text: str, chunk: int) -> list[str]:
    """The arguments of each tool call a streaming client accumulates, in call order."""
    args: dict[int, str] = {}
    for tc in _streamed_calls(tokenizer, request, text, chunk):
        args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    return [args[i] for i in sorted(args)]


CHUNKS = (1, 2, 3, 5, 8, 10_000)


@contextlib.contextmanager
def applied(*names: str):
    """The registry entries ``names`` applied on the installed vLLM for the block, then reverted
    (qwen3_config's cached configs are cleared both ways: they hold the converter)."""
    import vllm
    from vllm.parser import qwen3

    from vllm_dualgpu.patching.core import ALREADY, APPLIED, apply_patch, revert_patch
    from vllm_dualgpu.patching.registry import PATCHES

    patches = [p for p in PATCHES if p.name in names]
    assert len(patches) == len(names)
    mine = []
    try:
        for p in patches:
            outcome = apply_patch(p, vllm.__version__)
            assert outcome.status in (APPLIED, ALREADY), outcome.short()
            if outcome.status == APPLIED:
                mine.append(p)
        yield
    finally:
        for p in mine:
            revert_patch(p)
        qwen3.qwen3_config.cache_clear()


@contextlib.contextmanager
def reverted(*names: str):
    """vLLM's own functions for the block, whether or not something applied ``names`` before
    (re-applied afterwards if so)."""
    import vllm
    from vllm.parser import qwen3

    from vllm_dualgpu.patching.core import apply_patch, revert_patch
    from vllm_dualgpu.patching.registry import PATCHES

    patches = [p for p in PATCHES if p.name in names]
    assert len(patches) == len(names)
    were = [p for p in patches if revert_patch(p)]
    qwen3.qwen3_config.cache_clear()
    try:
        yield
    finally:
        for p in were:
            apply_patch(p, vllm.__version__)
        qwen3.qwen3_config.cache_clear()
