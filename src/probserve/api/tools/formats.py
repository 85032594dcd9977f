"""Tool-call formats: how a model writes its calls, picked once per model from its chat template
(or `--tool-call-parser`). Native formats are the model's own (its template renders the tools);
`generic` is probserve's for templates with no tool support: the tools in the system message and
the reply as one JSON object, always grammar-constrained (as llama.cpp's generic handler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ToolParser(enum.StrEnum):
    """`--tool-call-parser`'s choices (vLLM's names where vLLM has one)."""

    AUTO = "auto"
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    HARMONY = "harmony"  # gpt-oss: calls read from token ids (answers/harmony.py)
    GENERIC = "generic"


@dataclass(frozen=True)
class ToolFormat:
    """`opener`: the text that starts the calls (Hermes: each call; Mistral: the list of them;
    Llama 3: none, a reply that begins with "{" is a call); `closer`: what ends a Hermes call;
    `arguments`: the key the arguments go under; `special`: the opener is a special token (the
    reply is then decoded with special tokens, or the opener would vanish)."""

    parser: ToolParser
    opener: str = ""
    closer: str = ""
    arguments: str = "arguments"
    special: bool = False

    @property
    def native(self) -> bool:
        return self.parser is not ToolParser.GENERIC

    @property
    def tagged(self) -> bool:
        """Each call is wrapped in `opener` ... `closer` (Hermes', Qwen3-Coder's XML; harmony's
        calls reach the parser as Hermes calls)."""
        return self.parser in (ToolParser.HERMES, ToolParser.QWEN3_CODER, ToolParser.HARMONY)


FORMATS = {
    ToolParser.HERMES: ToolFormat(ToolParser.HERMES, "<tool_call>", "</tool_call>"),
    ToolParser.QWEN3_CODER: ToolFormat(ToolParser.QWEN3_CODER, "<tool_call>", "</tool_call>"),
    ToolParser.LLAMA3_JSON: ToolFormat(ToolParser.LLAMA3_JSON, arguments="parameters"),
    ToolParser.MISTRAL: ToolFormat(ToolParser.MISTRAL, "[TOOL_CALLS]", special=True),
    ToolParser.GENERIC: ToolFormat(ToolParser.GENERIC),
    # harmony's calls reach the parser as Hermes calls (answers/harmony.py writes them so)
    ToolParser.HARMONY: ToolFormat(ToolParser.HARMONY, "<tool_call>", "</tool_call>"),
}


def detect_format(template: str | None, asked: ToolParser = ToolParser.AUTO) -> ToolFormat:
    """The format `asked` for, or (auto) the one the template writes: harmony's (gpt-oss),
    Qwen3-Coder's XML calls (`<function=NAME>` and `<parameter=P>` inside `<tool_call>`:
    Qwen3-Coder, Qwen3.5, Qwen3.6), Hermes' `<tool_call>` (Qwen2.5, Qwen3, Hermes), Mistral's
    `[TOOL_CALLS]`, Llama 3.x's JSON calls (`<|python_tag|>` or `"parameters"` beside `tools`);
    generic when the template knows no tools."""
    if asked is not ToolParser.AUTO:
        return FORMATS[asked]
    text = template or ""
    if "<|channel|>" in text and "<|call|>" in text:  # gpt-oss's harmony
        return FORMATS[ToolParser.HARMONY]
    if "<function=" in text and "<parameter=" in text:
        return FORMATS[ToolParser.QWEN3_CODER]
    if "<tool_call>" in text:
        return FORMATS[ToolParser.HERMES]
    if "[TOOL_CALLS]" in text:
        return FORMATS[ToolParser.MISTRAL]
    if "tools" in text and ("<|python_tag|>" in text or '"parameters"' in text):
        return FORMATS[ToolParser.LLAMA3_JSON]
    return FORMATS[ToolParser.GENERIC]
