"""The field policy reaches every object of every route's body (docs/operations.md, "Unknown
fields"): each request model, and each model nested in one, keeps the keys it does not declare
(so api/server/fields.py names them back or refuses them) and bounds them; none drops them
silently, as a plain pydantic model does. And the numbers of a body are strict: JSON's true and
false are no integers."""

from __future__ import annotations

import typing

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from probserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RequestModel,
    RerankRequest,
    ScoreRequest,
)
from probserve.api.routes import (
    chat,
    completions,
    distributions,
    embeddings,
    messages,
    misc,
    playground,
    rerank,
    responses,
    score,
)
from probserve.api.server.fields import unknown_fields

ROUTERS = (chat, completions, distributions, embeddings, messages, misc, playground, rerank,
           responses, score)  # fmt: skip


def _models_in(annotation: object, out: set[type[BaseModel]]) -> None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        out.add(annotation)
        return
    for arg in typing.get_args(annotation):
        _models_in(arg, out)


def _body_models() -> dict[type[BaseModel], str]:
    """Every model a route's body is or holds, nested ones included -> where it is first met."""
    found: dict[type[BaseModel], str] = {}
    stack: list[tuple[type[BaseModel], str]] = []
    for module in ROUTERS:
        for route in module.router.routes:
            if not isinstance(route, APIRoute):
                continue
            hints = typing.get_type_hints(route.endpoint, include_extras=True)
            tops: set[type[BaseModel]] = set()
            _models_in(hints.get("body"), tops)
            stack += [(m, route.path) for m in tops]
    while stack:
        model, where = stack.pop()
        if model in found:
            continue
        found[model] = where
        for name, field in model.model_fields.items():
            inner: set[type[BaseModel]] = set()
            _models_in(field.annotation, inner)
            stack += [(m, f"{where} {model.__name__}.{name}") for m in inner]
    return found


def test_every_object_of_every_body_keeps_and_bounds_unknown_keys():
    models = _body_models()
    assert {CompletionRequest, ChatCompletionRequest, RerankRequest} <= set(models)
    assert len(models) > 40  # the nested ones too (messages, parts, tools, blocks...)
    silent = [
        f"{m.__name__} ({where})"
        for m, where in models.items()
        if not issubclass(m, RequestModel) or m.model_config.get("extra") != "allow"
    ]
    assert not silent, f"objects that drop unknown keys silently: {silent}"


def test_a_rerank_documents_unknown_keys_are_named():
    body = RerankRequest.model_validate(
        {"query": "q", "documents": ["a", {"text": "b", "title": "t", "meta": {"k": 1}}]}
    )
    assert unknown_fields(body) == ["documents[1].title", "documents[1].meta"]


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"prompt": [True, 5]}, "prompt"),
        (CompletionRequest, {"prompt": [[5], [False]]}, "prompt"),
        (CompletionRequest, {"prompt": "x", "max_tokens": True}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs"),
        (CompletionRequest, {"prompt": "x", "n": True}, "n"),
        (CompletionRequest, {"prompt": "x", "seed": False}, "seed"),
        (CompletionRequest, {"prompt": "x", "temperature": True}, "temperature"),
        (CompletionRequest, {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
        (EmbeddingRequest, {"input": [False, 1]}, "input"),
        (ScoreRequest, {"query": [True], "items": [[1]], "label_token_ids": [1]}, "query"),
        (ScoreRequest, {"query": [1], "items": [[1], [True]], "label_token_ids": [1]}, "items"),
        (ScoreRequest, {"query": "q", "items": ["a"], "label_token_ids": [False]},
         "label_token_ids"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                 "top_logprobs": True, "logprobs": True}, "top_logprobs"),
    ],
)  # fmt: skip
def test_a_boolean_is_no_number(model: type[BaseModel], body: dict, param: str):
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    first = err.value.errors()[0]
    assert str(first["loc"][0]) == param, err.value.errors()
    if any(v is True or v is False for v in _leaves(body[param])):
        assert any("is a boolean, not a number" in e["msg"] for e in err.value.errors())


def _leaves(value: object) -> list[object]:
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def test_integral_numbers_are_still_numbers():
    body = CompletionRequest.model_validate(
        {"prompt": [1, 2], "max_tokens": 3, "temperature": 1, "top_p": 0.5,
         "logit_bias": {"5": -1}, "seed": -(2**63)}
    )  # fmt: skip
    assert body.temperature == 1.0 and isinstance(body.temperature, float)
    assert body.logit_bias == {"5": -1.0} and body.prompt == [1, 2]
