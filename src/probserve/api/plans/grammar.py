"""Structured outputs: the one grammar a request asks for, from whichever field it used
(OpenAI's `response_format`, the Responses API's `text.format`, vLLM's `structured_outputs`
or its older `guided_*`), compiled to llguidance's form and checked against the model's
tokenizer here, in the API process, before anything is queued: a bad schema, regex or grammar
is a 400 naming its field. The engine gets the compiled grammar (EngineRequest.grammar)."""

from __future__ import annotations

import json

from probserve.api.answers.thinking import ThinkMarkers
from probserve.api.errors import bad_request
from probserve.api.off_loop import off_loop
from probserve.api.protocol import JsonSchemaFormat, ResponsesRequest, SamplingFields
from probserve.api.server.state import Serving
from probserve.api.structured import JSON_OPTIONS, GrammarAsk, closed_objects
from probserve.engine.grammar import grammar_error, matcher_error


def grammar_ask(body: SamplingFields) -> GrammarAsk | None:
    """The one grammar the body asks for (None: none); two ways of asking at once is a 400."""
    asks: list[GrammarAsk] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        asks.append(_format_ask(rf.type, rf.json_schema, "response_format"))
    if isinstance(body, ResponsesRequest) and body.text and body.text.format:
        fmt = body.text.format
        if fmt.type != "text":
            asks.append(_format_ask(fmt.type, fmt, "text.format"))
    so = body.structured_outputs
    if so is not None:
        given = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object or None,
        }
        picked = [(k, v) for k, v in given.items() if v is not None]
        if len(picked) != 1:
            raise bad_request(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
            )
        key, value = picked[0]
        kind = {"json": "json_schema"}.get(key, key)
        asks.append(GrammarAsk(kind, f"structured_outputs.{key}", value))
    guided = {
        "guided_json": ("json_schema", body.guided_json),
        "guided_regex": ("regex", body.guided_regex),
        "guided_choice": ("choice", body.guided_choice),
        "guided_grammar": ("grammar", body.guided_grammar),
    }
    asks += [GrammarAsk(kind, field, v) for field, (kind, v) in guided.items() if v is not None]
    if len(asks) > 1:
        fields = ", ".join(a.param for a in asks)
        raise bad_request(f"ask for one structured output, not several ({fields})", asks[1].param)
    return asks[0] if asks else None


def _format_ask(kind: str, schema: JsonSchemaFormat | None, param: str) -> GrammarAsk:
    if kind == "json_object":
        return GrammarAsk("json_object", param, {"type": "object"})
    if schema is None or schema.schema_ is None:
        raise bad_request(f"{param} of type json_schema needs its schema", param)
    return GrammarAsk("json_schema", param, schema.schema_)


def compile_grammar(ask: GrammarAsk, max_chars: int, max_choices: int, closed: bool = True) -> str:
    """The grammar in llguidance's form (the cheap size checks first). `closed`: object schemas
    that do not say additionalProperties take no other keys (`closed_objects`)."""
    import llguidance

    source = ask.source
    if ask.kind in ("json_schema", "json_object"):
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError:
                raise bad_request(
                    f"{ask.param} is not a JSON schema (not JSON)", ask.param
                ) from None
        if not isinstance(source, (dict, bool)):
            raise bad_request(f"{ask.param} must be a JSON schema (an object)", ask.param)
        _check_size(len(json.dumps(source)), max_chars, ask.param)
        text = json.dumps(closed_objects(source) if closed else source)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise bad_request(f"{ask.param}: {exc}", ask.param) from None
    if ask.kind == "choice":
        choices: list[str] = source
        if not 1 <= len(choices) <= max_choices:
            raise bad_request(
                f"{ask.param} must hold 1 to {max_choices} strings (got {len(choices)})", ask.param
            )
        _check_size(sum(len(c) for c in choices), max_chars, ask.param)
        if any(c == "" for c in choices):
            raise bad_request(f"{ask.param} holds an empty string", ask.param)
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(choices))
    _check_size(len(source), max_chars, ask.param)
    if ask.kind == "lark":  # built here (a tool call's), never a client's text
        return llguidance.LLMatcher.grammar_from_lark(source)
    if ask.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if "::=" in source:  # GBNF, converted
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            source = gbnf_to_lark(source)
        except (GbnfToLarkError, ValueError) as exc:
            raise bad_request(f"{ask.param}: {exc}", ask.param) from None
    lark = source
    return llguidance.LLMatcher.grammar_from_lark(lark)


def choice_lark(choices: list[str]) -> str:
    """The grammar of exactly one of `choices`, as one terminal: each choice a Lark string
    literal (JSON's escapes; duplicates once), the alternation a single lexeme. The lexer
    matches it (its states grow with the choices' characters, which max_grammar_chars bounds),
    so the parser's rows hold a few items whatever the number of choices; as a rule's
    alternatives, each choice would be an item of the first row, and llguidance's bound on a
    row (engine/grammar.py MAX_ITEMS_IN_ROW) would refuse 1,000 choices."""
    alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
    return f"start: CHOICE\nCHOICE: {alternatives}"


def _check_size(chars: int, cap: int, param: str) -> None:
    if chars > cap:
        raise bad_request(f"{param} holds {chars} characters; the limit is {cap}", param)


def _checked(ask: GrammarAsk, state: Serving) -> str:
    """Compiled and checked against the model's tokenizer: blocking, run it `off_loop`. A
    grammar that passed before (the model's GrammarCache) is not compiled or checked again."""
    limits = state.config.limits
    key = _cache_key(ask, limits.max_grammar_chars, limits.max_grammar_choices)
    cached = state.model.grammars.get(key) if key is not None else None
    if cached is not None:
        return cached
    closed = state.config.closed_schemas
    grammar = compile_grammar(ask, limits.max_grammar_chars, limits.max_grammar_choices, closed)
    error = grammar_error(grammar, state.model.grammar_tokenizer())
    error = error or matcher_error(grammar, state.model.grammar_tokenizer())
    if error:
        raise bad_request(f"{ask.param}: {error.strip()[:2000]}", ask.param)
    if key is not None:
        state.model.grammars.put(key, grammar)
    return grammar


def _cache_key(ask: GrammarAsk, max_chars: int, max_choices: int) -> str | None:
    """What identifies a grammar: its kind and source (None: a source too big to be one, left
    to compile_grammar's checks, which refuse it)."""
    try:
        source = json.dumps(ask.source, ensure_ascii=False)  # key order matters: kept
    except (TypeError, ValueError):
        return None
    if len(source) > 2 * max_chars + 4 * max_choices:
        return None
    return f"{ask.kind}\n{source}"


async def compiled_grammar(state: Serving, ask: GrammarAsk | None) -> str | None:
    """The grammar the engine gets (None: the request asked for none)."""
    if ask is None:
        return None
    return await off_loop(_checked, ask, state)


def after_thinking(markers: ThinkMarkers, answer: str | None, budget: int | None) -> str:
    """A thinking model's grammar: the thinking free (any text up to the end marker, at most
    `budget` tokens: past them the grammar forces the end marker, as the template would close
    the thinking), then the answer as `answer` (a compiled grammar; None: free). A prompt that
    did not open the thinking lets the reply begin with a think block or without."""
    limit = f"[max_tokens={budget}]" if budget is not None else ""
    thought = f"thought <[{markers.end}]> ws"
    if not markers.opened:
        thought = f"(<[{markers.start}]> {thought})?"
    rest = "@answer" if answer is not None else "free"
    lark = (
        f"start: {thought} {rest}\n"
        f"thought{limit}: /(.|\\n)*/\n"
        "ws: /[ \\t\\r\\n]{0,4}/\n"
        "free: /(.|\\n)*/\n"
    )
    grammars: list[dict[str, object]] = [{"lark_grammar": lark}]
    if answer is not None:
        grammars += named_answer(answer)
    return json.dumps({"grammars": grammars})


def named_answer(grammar: str) -> list[dict[str, object]]:
    """A compiled grammar's parts (llguidance's JSON form, or a Lark text), the first named
    `answer` for the thinking's grammar to refer to."""
    try:
        parts: list[dict[str, object]] = json.loads(grammar)["grammars"]
    except ValueError:  # Lark's text
        parts = [{"lark_grammar": grammar}]
    parts[0]["name"] = "answer"
    return parts
