"""/v1/completions against the logprobs contract, with the openai SDK and raw HTTP."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch
from reference import full_logprobs

from probserve.models import LoadedModel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
JAPANESE = "<|im_start|>user\nSay hello in Japanese.<|im_end|>\n<|im_start|>assistant\n"


def _spans_consistent(text: str, lp) -> None:  # type: ignore[no-untyped-def]
    """Offsets are monotone and the spans rebuild the text."""
    offs = lp.text_offset
    assert offs == sorted(offs)
    ends = [*offs[1:], len(text)]
    assert "".join(text[a:b] for a, b in zip(offs, ends, strict=True)) == text[offs[0] :]


def test_logprobs_arrays_and_top_dict(client: openai.OpenAI):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = len(lp.tokens)
    assert n == 6 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[tok] == val
        assert max(top.values()) == val  # greedy: the chosen token is the argmax, bit for bit
    assert lp.tokens[0] == " Paris"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 5


def test_logprobs_zero_holds_only_the_sampled_token(client: openai.OpenAI):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0.8, seed=1, logprobs=0
    )
    for tok, top in zip(
        r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs, strict=True
    ):
        assert list(top) == [tok]


def test_no_logprobs_is_null(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert r["choices"][0]["logprobs"] is None


def test_logprobs_cap(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=21)
    assert err.value.body["param"] == "logprobs"


def test_text_offset_counts_from_prompt_start(client: openai.OpenAI):
    r = client.completions.create(
        model=MODEL, prompt="test", max_tokens=3, temperature=0, logprobs=1
    )
    assert r.choices[0].logprobs.text_offset[0] == 4


def test_echo_scores_prompt_exactly(client: openai.OpenAI, smol: LoadedModel):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=5, echo=True
    )
    ch = r.choices[0]
    assert ch.text.startswith(prompt)
    lp = ch.logprobs
    ids = smol.tokenizer(prompt).input_ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) + 4
    gen = smol.tokenizer(ch.text[len(prompt) :], add_special_tokens=False).input_ids
    ref = full_logprobs(smol.model, ids + gen)
    for j in range(1, len(ids) + 4):
        assert abs(lp.token_logprobs[j] - float(ref[j - 1, ([*ids, *gen])[j]])) < 1e-4
    # with echo, text[off_j:off_j+1] is token j's text
    for j in range(len(lp.tokens) - 1):
        assert ch.text[lp.text_offset[j] : lp.text_offset[j + 1]] == lp.tokens[j]
    _spans_consistent(ch.text, lp)


def test_max_tokens_zero_scores_prompt(client: openai.OpenAI, smol: LoadedModel):
    prompt = "Paris is the capital of France."
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, temperature=0
    )
    ch = r.choices[0]
    n = len(smol.tokenizer(prompt).input_ids)
    assert ch.text == prompt and ch.finish_reason == "length"
    assert len(ch.logprobs.tokens) == n
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n


def test_lm_eval_style_request(http, smol: LoadedModel):
    """What lm-evaluation-harness sends: int[][] prompts, echo, max_tokens 1, logprobs 1."""
    ctx = smol.tokenizer("Question: what is two plus two? Answer:").input_ids
    cont = smol.tokenizer(" four", add_special_tokens=False).input_ids
    body = {
        "model": MODEL,
        "prompt": [ctx + cont, ctx],
        "echo": True,
        "max_tokens": 1,
        "logprobs": 1,
        "temperature": 0,
    }
    r = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ctx) + len(cont) + 1
    ref = full_logprobs(smol.model, ctx + cont)
    expected = sum(float(ref[len(ctx) + i - 1, t]) for i, t in enumerate(cont))
    got = sum(lp["token_logprobs"][len(ctx) : -1])
    assert abs(got - expected) < 1e-4
    for val, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert val <= max(top.values())


def test_prompt_forms(client: openai.OpenAI, smol: LoadedModel):
    ids = smol.tokenizer("One two three").input_ids
    for prompt, count in (("One two three", 1), (["One", "Two"], 2), (ids, 1), ([ids, ids], 2)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert [c.index for c in r.choices] == list(range(count))
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    text = client.completions.create(
        model=MODEL, prompt="One two three", max_tokens=4, temperature=0
    )
    assert same.choices[0].text == text.choices[0].text


def test_out_of_vocab_token_id(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1, 2, 10**7], max_tokens=1)
    assert err.value.body["param"] == "prompt"


def test_stop_string_truncates_text_and_arrays(client: openai.OpenAI):
    base = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0, logprobs=1
    )
    full = base.choices[0].text  # " Paris.\n\nThe answer is: 2"
    stop = "answer"
    assert stop in full
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=10,
        temperature=0,
        logprobs=1,
        stop=[stop, "zzz"],
    )
    ch = r.choices[0]
    assert ch.text == full[: full.index(stop)] and ch.finish_reason == "stop"
    lp = ch.logprobs
    plen = len("The capital of France is")
    spans = [*lp.text_offset[1:], plen + len(ch.text)]
    pieces = [ch.text[a - plen : b - plen] for a, b in zip(lp.text_offset, spans, strict=True)]
    assert "".join(pieces) == ch.text and pieces[-1] != ""
    # a stop string that straddles tokens ("Paris." split inside a token)
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=10,
        temperature=0,
        logprobs=1,
        stop="ris",
    )
    assert r.choices[0].text == " Pa" and r.choices[0].logprobs.tokens == [" Paris"]


def test_stop_token_kept_in_arrays_with_zero_width(client: openai.OpenAI):
    prompt = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, logprobs=1
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    lp = ch.logprobs
    assert lp.tokens[-1] == "<|im_end|>"
    assert "<|im_end|>" not in ch.text
    assert lp.text_offset[-1] == len(prompt) + len(ch.text)


def test_byte_fallback_tokens(client: openai.OpenAI):
    r = client.completions.create(
        model=MODEL, prompt=JAPANESE, max_tokens=12, temperature=0, logprobs=1, echo=True
    )
    ch = r.choices[0]
    lp = ch.logprobs
    partial = [j for j, t in enumerate(lp.tokens) if t.startswith("bytes:\\x")]
    assert partial, f"expected split multi-byte characters in {ch.text!r}"
    assert any(ord(c) > 0x3000 for c in ch.text)
    # the piece that completes a character carries it; the pieces before it are zero-width
    widths = [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False)]
    assert any(widths[j] == 0 for j in partial if j < len(widths))
    assert all(widths[j] in (0, 1) for j in partial if j < len(widths))
    assert all(lp.tokens[j].startswith("bytes:") for j, w in enumerate(widths) if w == 0)
    _spans_consistent(ch.text, lp)


def test_n_best_of_and_seed(client: openai.OpenAI):
    kw = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "max_tokens": 6,
        "logprobs": 0,
        "temperature": 1.0,
        "seed": 11,
    }
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    all3 = client.completions.create(**kw, n=3)
    # one seed, three draws: each choice its own stream of random numbers, so they differ
    assert len({tuple(c.logprobs.tokens) for c in all3.choices}) == 3, all3.choices
    assert client.completions.create(**kw, n=3).choices == all3.choices  # and the seed holds
    means = sorted(
        (
            (sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs), c.text)
            for c in all3.choices
        ),
        reverse=True,
    )
    best = client.completions.create(**kw, n=2, best_of=3)
    assert [c.text for c in best.choices] == [t for _, t in means[:2]]
    # best_of ranks by mean logprob even where the answer shows no logprobs
    unshown = client.completions.create(**{**kw, "logprobs": None}, n=2, best_of=3)
    assert [c.text for c in unshown.choices] == [t for _, t in means[:2]]
    assert all(c.logprobs is None for c in unshown.choices)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**{**kw, "n": 2, "best_of": 1})
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kw, n=1, best_of=2, stream=True)
    assert err.value.body["param"] == "best_of"


def test_requests_without_a_seed_differ(client: openai.OpenAI):
    """Without a seed each request (and each of its choices) draws its own random numbers: two
    requests sampling 16 tokens at temperature 1 differ, and so do the choices of one."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
          "logprobs": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    first, second = (client.completions.create(**kw) for _ in range(2))
    assert first.choices[0].logprobs.tokens != second.choices[0].logprobs.tokens
    both = client.completions.create(**kw, n=2).choices
    assert both[0].logprobs.tokens != both[1].logprobs.tokens


def test_context_overflow_names_numbers(client: openai.OpenAI, smol: LoadedModel):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=9000)
    msg = err.value.body["message"]
    assert str(smol.context_length) in msg and "9000" in msg and "2 tokens" in msg


def test_stream_equals_non_stream(client: openai.OpenAI):
    kw = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    full = client.completions.create(**kw).choices[0]
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == full.text
    cat: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for c in body:
        if c.choices[0].logprobs:
            for key in cat:
                cat[key] += getattr(c.choices[0].logprobs, key)
    # the second request may reuse cached prompt blocks (another batch shape): values agree
    # within the contract's 1e-4, everything else exactly
    assert cat["tokens"] == full.logprobs.tokens
    assert cat["text_offset"] == full.logprobs.text_offset
    assert cat["token_logprobs"] == pytest.approx(full.logprobs.token_logprobs, abs=1e-4)
    for got, want in zip(cat["top_logprobs"], full.logprobs.top_logprobs, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.keys() == want.keys()
            assert got == pytest.approx(want, abs=1e-4)
    assert body[-1].choices[0].finish_reason == "length"


def test_processed_mode_writes_minus_9999(http):
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 3,
        "temperature": 1.0,
        "top_k": 2,
        "seed": 5,
        "logprobs": 5,
        "logprobs_mode": "processed",
    }
    raw = http.post("/v1/completions", json=body).text
    assert "Infinity" not in raw and "NaN" not in raw
    tops = json.loads(raw)["choices"][0]["logprobs"]["top_logprobs"]
    for top in tops:
        assert sorted(top.values()).count(-9999.0) >= 3
        finite = [v for v in top.values() if v != -9999.0]
        assert abs(math.log(sum(math.exp(v) for v in finite))) < 1e-4  # renormalised


def test_raw_mode_matches_reference_under_temperature(client: openai.OpenAI, smol: LoadedModel):
    r = client.completions.create(
        model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=1.5, seed=3, logprobs=1
    )
    ids = smol.tokenizer("Hello, my name is").input_ids
    gen = smol.tokenizer(r.choices[0].text, add_special_tokens=False).input_ids
    ref = full_logprobs(smol.model, ids + gen)
    if len(gen) == 5:  # retokenization may merge differently; compare when it round-trips
        for j, v in enumerate(r.choices[0].logprobs.token_logprobs):
            assert abs(v - float(ref[len(ids) - 1 + j, gen[j]])) < 1e-4
    assert torch.isfinite(ref).all()


def test_vllm_logprobs_modes(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logprobs": 1}
    r = http.post("/v1/completions", json={**body, "logprobs_mode": "raw_logprobs"})
    assert r.status_code == 200
    r = http.post("/v1/completions", json={**body, "logprobs_mode": "processed_logits"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "logprobs_mode" and "logits" in error["message"]
