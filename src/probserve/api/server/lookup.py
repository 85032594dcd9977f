"""The model a request names, looked up once for every route: `serving_of(Body)` is a FastAPI
dependency over the route's own body (FastAPI parses the body once; the route and its
dependency share it) that gives the route the `Serving` of the model the body names (a 404
for a model this server does not serve):
`state: Annotated[Serving, Depends(serving_of(CompletionRequest))]`. It applies the field
policy to the body first (api/server/fields.py): a 400 under --strict-fields, else the unknown
fields named in the request's state for the header, the access line and the counter.

A model on demand (api/server/on_demand.py) is loaded here, the request waiting; the request
holds a lease on it until its response's last byte (the release is in the request's state for
the access-log middleware to run). The body's `keep_alive` (api/server/keep_alive.py) is this
lookup's field: validated on every route, taken for a model on demand, and named back as an
ignored field for a pinned model (which is never unloaded)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from pydantic import BaseModel

from probserve.api.server.fields import refuse, unknown_fields
from probserve.api.server.keep_alive import keep_alive_seconds
from probserve.api.server.state import ServerState, Serving

KEEP_ALIVE = "keep_alive"


class _Named(Protocol):
    model: str | None


def server_state(request: Request) -> ServerState:
    """The state the app was built around (api/app.py)."""
    state: ServerState = request.app.state.probserve
    return state


def field_policy(request: Request, state: ServerState, body: BaseModel) -> None:
    """The unknown fields of `body`: a 400 for the first under --strict-fields, else named in
    the request's state (the header, the access line) and counted."""
    names = unknown_fields(body)
    if names and state.config.strict_fields:
        raise refuse(names[0])
    if names:
        request.state.ignored_fields = names
        route = getattr(request.scope.get("route"), "path", "unmatched")
        state.metrics.ignored_fields.labels(route).inc(len(names))


def serving_of(body_type: type[_Named]) -> Callable[..., Awaitable[Serving]]:
    """The dependency giving the Serving of the model a `body_type` body names."""

    async def lookup(request: Request, body: Any) -> Serving:
        state = server_state(request)
        keep_alive = None
        if isinstance(body, BaseModel) and body.model_extra and KEEP_ALIVE in body.model_extra:
            keep_alive = keep_alive_seconds(body.model_extra[KEEP_ALIVE])
            named = getattr(body, "model", None) or state.default_name
            if state.on_demand is not None and named in state.on_demand.entries:
                del body.model_extra[KEEP_ALIVE]  # taken: the model's keep-alive
        if isinstance(body, BaseModel):
            field_policy(request, state, body)
        serving, release = await state.acquire(body.model, keep_alive)
        if release is not None:
            request.state.on_end = release
        return serving

    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
        inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body_type),
    ]
    lookup.__signature__ = inspect.Signature(params, return_annotation=Serving)  # type: ignore[attr-defined]
    return lookup
