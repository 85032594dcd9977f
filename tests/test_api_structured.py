"""Structured outputs over HTTP: every way of asking (OpenAI's response_format, the Responses
API's text.format, vLLM's structured_outputs and guided_*), the openai SDK's parse helpers,
logprobs that name their distribution against the reference, hostile grammars, and no field
silently ignored."""

from __future__ import annotations

import json
import math

import llguidance
import numpy as np
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from reference import full_logprobs

from probserve.api.plans.grammar import GrammarAsk, compile_grammar
from probserve.engine.core.grammar import Grammars
from probserve.engine.grammar import llguidance_tokenizer
from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LABELS = ["sports", "politics", "science", "music", "cooking"]


def _err(r, param: str) -> dict:  # type: ignore[no-untyped-def]
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error


def test_unknown_fields_are_named_back_and_known_ones_still_checked(http):
    """The field policy (docs/operations.md, "Unknown fields"): an unknown field is served and
    named back (--strict-fields' 400s: tests/test_clients.py); a known field's value is checked."""
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    r = http.post("/v1/completions", json={**base, "frobnicate": 1})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "frobnicate"
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "modalities": [],
                                         "max_output_tokens": 2})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "modalities"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    _err(http.post("/v1/chat/completions", json={**chat, "tools": []}), "tools")
    _err(http.post("/v1/chat/completions", json={**chat, "store": True}), "store")
    message = {"role": "user", "content": "Hi", "tool_call_id": "x"}
    _err(
        http.post("/v1/chat/completions", json={**chat, "messages": [message]}),
        "messages[0].tool_call_id",
    )
    # accepted with no effect, and said so in docs/logprobs.md
    ok = {**chat, "user": "u1", "metadata": {"k": "v"}, "store": False}
    ok["messages"] = [*chat["messages"], {"role": "assistant", "content": "Hello",
                                          "refusal": None, "tool_calls": None}]  # fmt: skip
    assert http.post("/v1/chat/completions", json=ok).status_code == 200


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int


def test_sdk_parse_helpers(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Describe a person called Ada, aged 36, as JSON."}]
    done = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Person, temperature=0, max_tokens=60
    )
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.name) <= 12
    reply = client.responses.parse(
        model=MODEL, input=messages[0]["content"], text_format=Person, temperature=0,
        max_output_tokens=60,
    )  # fmt: skip
    assert isinstance(reply.output_parsed, Person)


def test_every_way_of_asking_gives_the_same_constrained_answer(http):
    body = {"model": MODEL, "prompt": "Topic of 'the match ended 2-1':", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    asks = [
        {"structured_outputs": {"choice": LABELS}},
        {"guided_choice": LABELS},
        {"structured_outputs": {"regex": "|".join(LABELS)}},
        {"guided_grammar": "start: " + " | ".join(json.dumps(x) for x in LABELS)},
        {"guided_grammar": "root ::= " + " | ".join(json.dumps(x) for x in LABELS)},  # GBNF
    ]
    texts = set()
    for ask in asks:
        r = http.post("/v1/completions", json={**body, **ask})
        assert r.status_code == 200, (ask, r.text)
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1 and texts.pop() in LABELS
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Give me a JSON object."}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    answer = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = answer["message"]["content"]
    assert content.startswith("{")  # an object, complete when the grammar ended it
    if answer["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


def test_choice_logprobs_name_their_distribution(http, smol: LoadedModel):
    """`both`: raw is the model's own row, processed the row masked to what the grammar allows
    and renormalised; constraint_logmass the raw mass allowed (every token that starts a
    label: "m", "mu", "music"...), so processed = raw - constraint_logmass."""
    prompt = smol.tokenizer("Article: the orchestra played Mahler. Topic:").input_ids
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 5,
        "logprobs_mode": "both", "structured_outputs": {"choice": LABELS},
    }  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] in LABELS
    lp = choice["logprobs"]
    ids = smol.tokenizer(choice["text"], add_special_tokens=False).input_ids
    rows = full_logprobs(smol.model, [*prompt, *ids])
    first = rows[len(prompt) - 1]
    grammars = Grammars(smol.tokenizer, smol.vocab_size, smol.eos_token_ids)
    grammar = compile_grammar(GrammarAsk("choice", "choice", LABELS), 65_536, 1024)
    allowed = grammars.allowed(grammars.matcher(grammar), frozenset(smol.eos_token_ids))
    mass = float(torch.logsumexp(first[allowed].double(), 0))
    assert abs(lp["token_logprobs"][0] - float(first[ids[0]])) < 1e-4
    assert abs(lp["constraint_logmass"][0] - mass) < 1e-4
    assert abs(lp["processed"]["token_logprobs"][0] - (float(first[ids[0]]) - mass)) < 1e-4
    assert all(v <= 1e-6 for v in lp["constraint_logmass"])
    # the processed alternatives: allowed tokens only, each the reference's raw minus the mass
    by_text = {smol.tokenizer.decode([t]): t for t in allowed.nonzero().flatten().tolist()}
    for text, value in lp["processed"]["top_logprobs"][0].items():
        assert abs(value - (float(first[by_text[text]]) - mass)) < 1e-4
    posterior = sum(math.exp(float(first[t]) - mass) for t in by_text.values())
    assert abs(posterior - 1.0) < 1e-4


def test_stream_equals_non_stream_under_a_schema(http):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Name a city, as JSON."}],
        "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }  # fmt: skip
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    text, entries = "", []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    entries += (c.get("logprobs") or {}).get("content") or []
    assert text == whole["message"]["content"] and "city" in json.loads(text)
    assert entries == whole["logprobs"]["content"]
    assert all("constraint_logmass" in e for e in entries)


def test_hostile_grammars_are_400s_and_leave_the_server_as_it_was(http):
    canary = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
              "temperature": 0, "logprobs": 1}  # fmt: skip
    before = http.post("/v1/completions", json=canary).json()["choices"][0]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    cases = [
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "[^\\x00-\\U0010ffff]"}}, "structured_outputs.regex"),
        (
            {
                "guided_json": {
                    "type": "object",
                    "required": ["a"],
                    "properties": {},
                    "additionalProperties": False,
                }
            },
            "guided_json",
        ),  # unsatisfiable
        ({"guided_json": True}, "guided_json"),
        (
            {"structured_outputs": {"choice": [f"c{i}" for i in range(2000)]}},
            "structured_outputs.choice",
        ),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"guided_json": "not json"}, "guided_json"),
        (
            {"guided_json": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}},
            "guided_json",
        ),
        ({"guided_json": {"type": "string", "pattern": "(((a"}}, "guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"guided_grammar": "start: " + "(" * 5000 + '"a"' + ")" * 5000}, "guided_grammar"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ]
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    cases.append(({"guided_json": deep}, "guided_json"))
    for extra, param in cases:
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400, (param, r.status_code, r.text[:300])
        assert r.json()["error"]["param"] == param, (param, r.text[:300])
    after = http.post("/v1/completions", json=canary).json()["choices"][0]
    assert after == before
    assert http.get("/health").status_code == 200


def test_the_largest_choice_allowed_is_served(http, smol: LoadedModel):
    """--max-grammar-choices (1024) holds at exactly its bound, whatever the labels' shape
    (short, long, sharing long prefixes, one a prefix of another): the answer is one of them,
    the grammar is the language of the plain alternation of the labels (the same tokens
    allowed at every step of a label, under llguidance's default row bound, which the plain
    one meets), and 1,025 is refused naming the field."""
    shapes = {
        "short": [f"c{i}" for i in range(1024)],
        "long": [f"label number {i:04d} " + "of many words " * 3 for i in range(1024)],
        "prefixes": ["yes" * (i % 16 + 1) + f" {i}" for i in range(1024)],
    }
    body = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 64, "temperature": 0}
    lltok = llguidance_tokenizer(smol.tokenizer, smol.vocab_size, sorted(smol.eos_token_ids))
    for name, labels in shapes.items():
        assert len(set(labels)) == 1024 and sum(map(len, labels)) <= 65_536
        for ask in ({"structured_outputs": {"choice": labels}}, {"guided_choice": labels}):
            r = http.post("/v1/completions", json={**body, **ask})
            assert r.status_code == 200, (name, r.text[:300])
            choice = r.json()["choices"][0]
            assert choice["text"] in labels and choice["finish_reason"] == "stop", (name, choice)
        grammar = compile_grammar(GrammarAsk("choice", "choice", labels), 65_536, 1024)
        plain = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(x) for x in labels)
        )
        for label in labels[::97]:
            ours, theirs = (llguidance.LLMatcher(lltok, g, log_level=0) for g in (grammar, plain))
            for token in smol.tokenizer(label, add_special_tokens=False).input_ids:
                allowed = _llguidance_allowed(ours, smol.vocab_size)
                assert allowed == _llguidance_allowed(theirs, smol.vocab_size), (name, label)
                assert ours.consume_token(token) and theirs.consume_token(token)
            assert ours.is_accepting() and theirs.is_accepting()
    for field, ask in (
        ("structured_outputs.choice", {"structured_outputs": {"choice": shapes["short"] + ["x"]}}),
        ("guided_choice", {"guided_choice": shapes["short"] + ["x"]}),
    ):
        err = _err(http.post("/v1/completions", json={**body, **ask}), field)
        assert "1 to 1024" in err["message"], err


TOPICS = (  # noqa: SIM905
    "sports politics science music cooking travel health finance weather history art film "
    "television books poetry theatre dance fashion beauty fitness nutrition medicine biology "
    "chemistry physics astronomy geology ecology climate energy oil gas mining farming "
    "gardening pets wildlife oceans rivers mountains deserts forests cities villages housing "
    "architecture engineering robotics software hardware internet security privacy law crime "
    "courts police military diplomacy elections taxes banking insurance markets stocks bonds "
    "startups retail shipping aviation railways cars cycling football tennis golf chess "
    "gaming toys education schools universities research language religion philosophy "
    "psychology parenting weddings funerals holidays festivals food wine beer coffee tea "
    "baking restaurants bakeries"
).split()


def _allowed_after(tokens: list[str], prefix: str, starts: set[str]) -> list[int]:
    """Ids whose text extends `prefix` toward some label (`starts`: every label's non-empty
    prefixes): from the vocabulary and the labels alone, not by any grammar engine."""
    return [t for t, text in enumerate(tokens) if text and prefix + text in starts]


def _llguidance_allowed(matcher, vocab_size: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The ids llguidance's own matcher allows next (the grammar's definition of allowed)."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab_size].nonzero()[0].tolist()


def test_a_100_label_choice_over_64_prompts_is_the_renormalised_reference(http, smol: LoadedModel):
    """Every answer is one of 100 labels; at every generated position the processed logprob is
    the reference's raw one renormalised over the tokens that continue toward a label, and
    `constraint_logmass` that set's raw mass: the per-label posterior a client reads off."""
    labels = TOPICS[:100]
    assert len(set(labels)) == 100
    subjects = ["the match", "the vote", "a comet", "a new album", "a recipe", "a long trip",
                "a vaccine", "the bank", "a storm", "an old war", "a painting", "a movie",
                "a sitcom", "a novel", "a sonnet", "a play"]  # fmt: skip
    prompts = [f"Article {i}: a story about {subjects[i % 16]}. Its topic, in one word:"
               for i in range(64)]  # fmt: skip
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 8, "temperature": 0, "logprobs": 20,
            "logprobs_mode": "both", "structured_outputs": {"choice": labels}}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 64 and all(c["text"] in labels for c in choices)
    vocab = [smol.tokenizer.decode([t]) for t in range(smol.vocab_size)]
    id_of: dict[str, int] = {}
    for t, text in enumerate(vocab):
        id_of.setdefault(text, t)
    starts = {label[:k] for label in labels for k in range(1, len(label) + 1)}
    lltok = llguidance_tokenizer(smol.tokenizer, smol.vocab_size, sorted(smol.eos_token_ids))
    grammar = compile_grammar(GrammarAsk("choice", "choice", labels), 65_536, 1024)
    first_tokens = _allowed_after(vocab, "", starts)
    worst = 0.0
    for prompt, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        ids = smol.tokenizer(prompt).input_ids
        # the tokens it chose (the grammar lets a label be spelled in any of its tokenizations)
        generated = [id_of[text] for text in lp["tokens"]]
        rows = full_logprobs(smol.model, [*ids, *generated])
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        prefix = ""
        for j, token in enumerate(generated):
            row = rows[len(ids) - 1 + j]
            allowed = _llguidance_allowed(matcher, smol.vocab_size)
            # what may come next continues toward a label; first, every label's first tokens
            assert set(allowed) <= set(_allowed_after(vocab, prefix, starts))
            assert j or allowed == first_tokens
            assert token in allowed and matcher.consume_token(token)
            mass = float(torch.logsumexp(row[allowed].double(), 0))
            got = (lp["constraint_logmass"][j], lp["token_logprobs"][j],
                   lp["processed"]["token_logprobs"][j])  # fmt: skip
            want = (mass, float(row[token]), float(row[token]) - mass)
            worst = max(worst, *(abs(x - y) for x, y in zip(got, want, strict=True)))
            if j == 0:  # the alternatives: the labels' first tokens, renormalised
                by_text = {vocab[t]: t for t in allowed}
                for text, value in lp["processed"]["top_logprobs"][0].items():
                    worst = max(worst, abs(value - (float(row[by_text[text]]) - mass)))
            prefix += vocab[token]
        assert prefix == choice["text"]
    assert worst < 1e-4, worst
