"""Tool calls below HTTP: each format's reply parser (streamed in any pieces = whole), the
format a template writes, the checks of a tool ask, the generic format's prompt, and each
format's grammar driving the embedded model to calls that parse and follow their schemas."""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import run_core

from probserve.api.errors import APIError
from probserve.api.plans.grammar import compile_grammar
from probserve.api.protocol import FunctionDefinition, NamedFunction, NamedToolChoice
from probserve.api.tools.ask import ToolAsk, tool_ask
from probserve.api.tools.formats import FORMATS, ToolParser, detect_format
from probserve.api.tools.grammar import tool_grammar
from probserve.api.tools.prompt import tool_prompt
from probserve.api.tools.reply import ReplyParser, arguments_schemas, whole_reply
from probserve.engine import EngineConfig, EngineCore, EngineRequest, SamplingParams
from probserve.engine.grammar import grammar_error, llguidance_tokenizer
from probserve.models import LoadedModel

H, L3, M, G = ToolParser.HERMES, ToolParser.LLAMA3_JSON, ToolParser.MISTRAL, ToolParser.GENERIC
Q = ToolParser.QWEN3_CODER

# (format, reply text, content, [(name, arguments)])
REPLIES = [
    (
        H,
        'Sure.\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
        '\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        "Sure.",
        [("get", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("b", "{}")],
    ),
    (H, "no calls here <tool_ca", "no calls here <tool_ca", []),
    (H, "<tool_call>\nnot json</tool_call> tail", "<tool_call>\nnot json</tool_call> tail", []),
    (
        H,
        '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',
        None,
        [("f", '{"x": 1}')],
    ),
    (
        H,
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
        None,
        [("f", '{"x": 1}')],
    ),
    (H, '<tool_call>\n{"name": "f", "arguments": {"x": 1', None, [("f", '{"x": 1')]),  # cut short
    (H, '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", "{}")]),
    (
        H,
        '<tool_call>\n{"name": 3, "arguments": {}}',
        '<tool_call>\n{"name": 3, "arguments": {}}',
        [],
    ),
    (
        L3,
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"x": 1}'), ("g", "{}")],
    ),
    (L3, ' Hello {"name"}', ' Hello {"name"}', []),
    (
        M,
        'ok[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, '
        '{"name": "g", "arguments": {"y": "z"}}]',
        "ok",
        [("f", '{"x": 1}'), ("g", '{"y": "z"}')],
    ),
    (
        G,
        '{"tool_calls": [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]}',
        None,
        [("f", '{"x": 1}'), ("g", "{}")],
    ),
    (G, '{"content": "caf\\u00e9 \\ud83d\\ude00 \\"q\\"\\n end"}', 'café 😀 "q"\n end', []),
    (G, "plain", "plain", []),
    (
        Q,
        "Sure.\n<tool_call>\n<function=get>\n<parameter=city>\nSan </x> Jos\u00e9\n</parameter>\n"
        '<parameter=n>\n[1, {"a": "}"}]\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=b>\n</function>\n</tool_call>",
        "Sure.",
        [("get", '{"city": "San </x> Jos\u00e9", "n": [1, {"a": "}"}]}'), ("b", "{}")],
    ),
    (Q, "<tool_call>\n<func>x</tool_call> t", "<tool_call>\n<func>x</tool_call> t", []),
    (Q, "no calls <tool_c", "no calls <tool_c", []),
    (Q, "<tool_call>\n<function=f>\n<parameter=x>\n1", None, [("f", "")]),  # cut short
]


def _streamed(
    fmt: ToolParser, text: str, cuts: list[int], cut: bool = False
) -> tuple[str | None, list]:
    """The reply fed in the pieces `cuts` makes, put back together as a client would (`cut`:
    the reply was cut short)."""
    parser = ReplyParser(FORMATS[fmt])
    content, calls = "", {}  # type: ignore[var-annotated]
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    for d in [*deltas, parser.close(cut)]:
        content += d.content
        for c in d.calls:
            call = calls.setdefault(c.index, {"name": None, "arguments": ""})
            if c.id is not None:
                assert call["name"] is None, "a call starts once"
                call["name"] = c.name
            call["arguments"] += c.arguments
    assert all(v["name"] for v in calls.values()), "every call's first part names it"
    got = [(v["name"], v["arguments"]) for _, v in sorted(calls.items())]
    return (content if parser.content_sent else None), got


@pytest.mark.parametrize("case", range(len(REPLIES)))
def test_replies_parse_the_same_streamed_in_any_pieces(case: int):
    fmt, text, content, calls = REPLIES[case]
    whole = whole_reply(FORMATS[fmt], text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert all(c.id.startswith("call_") for c in whole.calls)
    for step in (1, 2, 3, 7):
        assert _streamed(fmt, text, list(range(step, len(text), step))) == (content, calls)


# replies with content and two calls, each format's (the content the whole reply has)
CUT_REPLIES = [
    (H, 'Sure.\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "Sure."),
    (M, 'ok[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     "ok"),
    (L3, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     None),
    (G, '{"tool_calls": [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]}',
     None),
    (G, '{"content": "caf\\u00e9 and more"}', "café and more"),
    (Q, "Sure.\n<tool_call>\n<function=get>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>", "Sure."),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CUT_REPLIES)))
def test_a_reply_cut_short_never_gives_a_calls_text_as_content(case: int):
    """Cut anywhere (max_tokens): the content is the whole reply's so far (never a part of a
    call: an opener, a call object before its name), the calls are the whole reply's so far
    (the last one's arguments as far as written), streamed in any pieces as whole."""
    fmt, text, content = CUT_REPLIES[case]
    full = whole_reply(FORMATS[fmt], text)
    assert full.content == content
    assert len(full.calls) == (0 if fmt is G and content else 2)
    full_calls = [(c.name, c.arguments) for c in full.calls]
    for end in range(len(text) + 1):
        part = whole_reply(FORMATS[fmt], text[:end], cut=True)
        got = part.content
        assert got is None or (content or "").startswith(got.rstrip()), (text[:end], got)
        calls = [(c.name, c.arguments) for c in part.calls]
        assert len(calls) <= len(full_calls)
        for (name, args), (full_name, full_args) in zip(calls, full_calls, strict=False):
            assert name == full_name and full_args.startswith(args), (text[:end], calls)
        for step in (1, 3):
            cuts = list(range(step, end, step))
            assert _streamed(fmt, text[:end], cuts, cut=True) == (got, calls), text[:end]


def test_the_format_comes_from_the_template():
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}").parser is G
    assert detect_format("... <tool_call>\n{{ tool_call | tojson }}").parser is H
    assert detect_format("{{ '[TOOL_CALLS]' }}{{ tools }}").parser is M
    llama = '{%- if tools %}{"name": function name, "parameters": dictionary}{% endif %}'
    assert detect_format(llama).parser is L3
    assert detect_format(None).parser is G
    assert detect_format("<tool_call>", ToolParser.GENERIC).parser is G  # the flag wins
    qwen35 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k }}"
    assert detect_format(qwen35).parser is Q


def test_xml_arguments_are_typed_by_their_schemas():
    """Qwen3-Coder's XML values: a string parameter's text stays a string (even "42" or
    quoted text), any other's is the JSON it holds; text that is no JSON is a string."""
    schemas = {"f": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "o": {"type": "object"},
        "e": {"enum": ["a", "b"]}, "n": {"type": ["string", "null"]}, "u": {}}}}  # fmt: skip
    values = [("s", "42"), ("i", "42"), ("o", '{"k": [true]}'), ("e", "a"), ("n", "null"),
              ("u", "not json"), ("s", '"quoted"'), ("u", '"quoted"'), ("i", "4 2")]  # fmt: skip
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values)
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    (call,) = whole_reply(FORMATS[Q], text, schemas=schemas).calls
    assert call.complete
    pairs = json.loads(call.arguments, object_pairs_hook=list)  # keys repeat: as pairs
    assert pairs == [
        ("s", "42"), ("i", 42), ("o", [("k", [True])]), ("e", "a"), ("n", None),
        ("u", "not json"), ("s", '"quoted"'), ("u", '"quoted"'), ("i", "4 2"),
    ]  # fmt: skip


WEATHER = FunctionDefinition(
    name="get_weather",
    description="The weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
ADD = FunctionDefinition(
    name="add",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)


def _bad(fn, param: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as info:
        fn()
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_tool_asks_are_checked():
    generic = FORMATS[G]
    _bad(lambda: tool_ask(None, "required", None, generic), "tool_choice")
    _bad(lambda: tool_ask(None, None, False, generic), "parallel_tool_calls")
    _bad(lambda: tool_ask([ADD, ADD], None, None, generic), "tools")
    named = NamedToolChoice(type="function", function=NamedFunction(name="nope"))
    _bad(lambda: tool_ask([ADD], named, None, generic), "tool_choice")
    odd = FunctionDefinition(name="odd", parameters=[1])
    _bad(lambda: tool_ask([odd], None, None, generic), "tools[0].function.parameters")
    assert tool_ask([ADD], "none", None, generic) is None
    assert tool_ask(None, "none", None, generic) is None
    ask = tool_ask([ADD, WEATHER], named.model_copy(update={"function": NamedFunction(name="add")}),
                   None, generic)  # fmt: skip
    assert ask is not None and ask.choice == "named" and ask.offered == (ADD,)
    assert ask.most_calls == 1


def test_the_generic_prompt_tells_the_tools_and_replays_calls_and_results():
    ask = ToolAsk((ADD,), "auto", True, FORMATS[G])
    history = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
                }
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
    ]
    shown = tool_prompt(history, ask, FORMATS[G])
    assert shown.origins == [None, 0, 1, 2] and shown.template_kwargs == {}
    assert shown.messages[0]["role"] == "system" and '"name": "add"' in shown.messages[0]["content"]
    assert '{"content":' in shown.messages[0]["content"]  # auto: a reply may be content
    assert json.loads(shown.messages[2]["content"]) == {
        "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    }
    assert shown.messages[3]["role"] == "user"
    assert json.loads(shown.messages[3]["content"]) == {
        "tool_result": {"tool_call_id": "c1", "content": 3, "name": "add"}  # JSON: its value
    }
    with_system = [{"role": "system", "content": "Be brief."}, *history]
    shown = tool_prompt(with_system, ToolAsk((ADD,), "required", True, FORMATS[G]), FORMATS[G])
    # required: the reply's certain start is the prompt's last (assistant) turn, probserve's
    assert shown.origins == [0, 1, 2, 3, None] and shown.primed
    assert shown.messages[-1] == {"role": "assistant", "content": '{"tool_calls": [{"name": "'}
    assert shown.messages[0]["content"].startswith("Be brief.\n\n")
    assert '{"content":' not in shown.messages[0]["content"]  # required: calls only
    native = tool_prompt(history, ask, FORMATS[H])
    assert (
        native.messages == history
        and native.template_kwargs["tools"][0]["function"]["name"] == "add"
    )


@pytest.fixture(scope="module")
def core(smol: LoadedModel) -> EngineCore:
    return EngineCore(smol, EngineConfig(kv_cache_gib=0.25))


def _calls_of(smol: LoadedModel, core: EngineCore, ask: ToolAsk, rid: str) -> ReplyParser:
    """The model's greedy reply under the ask's grammar, parsed."""
    asked = tool_grammar(ask, None)
    assert asked is not None
    most = 100 if ask.fmt.parser is Q else 80  # XML calls take more tokens than JSON ones
    grammar = compile_grammar(asked, 65_536, 1024)
    lltok = llguidance_tokenizer(smol.tokenizer, smol.vocab_size, sorted(smol.eos_token_ids))
    assert grammar_error(grammar, lltok) == ""
    prompt = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tuple(smol.tokenizer(prompt, add_special_tokens=False).input_ids)
    req = EngineRequest(
        rid, ids, SamplingParams(temperature=0.0, max_tokens=most), None, grammar=grammar
    )
    outs = run_core(core, [req])[rid]
    text = smol.tokenizer.decode(
        [t for o in outs for t in o.new_token_ids], skip_special_tokens=True
    )
    print(rid, repr(text))  # shown where a check fails
    return whole_reply(ask.fmt, text, schemas=arguments_schemas(ask))


def _follows_schema(call_name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if call_name == "add":
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    else:
        assert call_name == "get_weather" and set(args) == {"city", "unit"}
        assert args["unit"] in ("c", "f") and len(args["city"]) <= 20


@pytest.mark.parametrize("parser", [H, Q, L3, M, G])
def test_each_formats_grammar_makes_calls_that_parse_and_follow_their_schemas(
    smol: LoadedModel, core: EngineCore, parser: ToolParser
):
    fmt = FORMATS[parser]
    required = _calls_of(smol, core, ToolAsk((WEATHER, ADD), "required", True, fmt), f"r-{parser}")
    assert required.calls and required.content is None
    for c in required.calls:
        _follows_schema(c.name, c.arguments)
    one = _calls_of(smol, core, ToolAsk((WEATHER, ADD), "required", False, fmt), f"o-{parser}")
    assert len(one.calls) == 1
    named = ToolAsk((WEATHER, ADD), "named", True, fmt, "add")
    forced = _calls_of(smol, core, named, f"n-{parser}")
    assert [c.name for c in forced.calls] == ["add"]
    _follows_schema("add", forced.calls[0].arguments)
    # auto, with at most one call: content, or one call that follows its schema
    auto = _calls_of(smol, core, ToolAsk((WEATHER, ADD), "auto", False, fmt), f"a-{parser}")
    assert len(auto.calls) <= 1 and (auto.calls or auto.content)
    for c in auto.calls:
        _follows_schema(c.name, c.arguments)
