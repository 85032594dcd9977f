"""OpenAI request fields -> the engine's SamplingParams (the request limits they need first)."""

from __future__ import annotations

import dataclasses

from probserve.api.errors import bad_request
from probserve.api.protocol import SamplingFields
from probserve.api.server.limits import Limits
from probserve.engine import SamplingParams
from probserve.models.generation_config import SamplingDefaults


def check_request(req: SamplingFields, limits: Limits) -> tuple[str, ...]:
    """Apply the request limits shared by completions and chat; returns the stop strings."""
    stops = stop_strings(req.stop)
    limits.check_stop(stops)
    limits.check_stop_token_ids(req.stop_token_ids)
    limits.check_logit_bias(req.logit_bias)
    return stops


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    return tuple(s for s in items if s)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias token id {tid} is outside the vocabulary", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request("logit_bias values must be between -100 and 100", "logit_bias")
        out[tid] = float(value)
    return out


NO_DEFAULTS = SamplingDefaults()


def _given(value: float | None, default: float | None, openai: float) -> float:
    """The request's value, else the model's default, else OpenAI's."""
    if value is not None:
        return value
    return openai if default is None else default


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    vocab_size: int,
    seed: int | None,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> SamplingParams:
    """The engine's parameters for one candidate (limits are checked by `check_request`); a
    sampling field the request leaves out takes the model's default (`defaults`), else
    OpenAI's."""
    d = defaults
    for tid in req.stop_token_ids or ():
        if not 0 <= tid < vocab_size:
            raise bad_request(f"stop_token_ids: {tid} is outside the vocabulary", "stop_token_ids")
    return SamplingParams(
        temperature=_given(req.temperature, d.temperature, 1.0),
        # below 1/vocab every top_p keeps the one most likely token: a denormal one (5e-324)
        # would make the sampler's arithmetic non-finite, so it is raised to the same effect
        top_p=max(_given(req.top_p, d.top_p, 1.0), 1e-6),
        top_k=max(0, int(_given(req.top_k, d.top_k, 0))),
        min_p=_given(req.min_p, d.min_p, 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_given(req.repetition_penalty, d.repetition_penalty, 1.0),
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def budgeted(
    sampling: SamplingParams, prompt_tokens: int, context: int, default: int | None
) -> SamplingParams:
    """`sampling` for one prompt, with the server's default budget where the request set none
    (`max_tokens` None): at most `default` tokens (None: no default), and no more than the
    context leaves after the prompt. A prompt that leaves no room keeps None (the engine's 400
    names the prompt); a budget the request set is kept as it is."""
    room = context - prompt_tokens
    if sampling.max_tokens is not None or default is None or room <= 0:
        return sampling
    return dataclasses.replace(sampling, max_tokens=min(default, room))


def candidate_params(
    req: SamplingFields,
    max_tokens: int | None,
    vocab_size: int,
    n: int,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> list[SamplingParams]:
    """Sampling for each of `n` candidates: candidate i samples with seed + i."""
    first = sampling_params(req, max_tokens, vocab_size, req.seed, defaults)
    if req.seed is None:
        return [first] * n
    return [dataclasses.replace(first, seed=req.seed + i) for i in range(n)]
