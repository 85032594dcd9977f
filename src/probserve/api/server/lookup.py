"""The model a request names, looked up once for every route: `serving_of(Body)` is a FastAPI
dependency over the route's own body (FastAPI parses the body once; the route and its
dependency share it) that gives the route the `Serving` of the model the body names (a 404
for a model this server does not serve):
`state: Annotated[Serving, Depends(serving_of(CompletionRequest))]`. It applies the field
policy to the body first (api/server/fields.py): a 400 under --strict-fields, else the unknown
fields named in the request's state for the header, the access line and the counter."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request
from pydantic import BaseModel

from probserve.api.server.fields import refuse, unknown_fields
from probserve.api.server.state import ServerState, Serving


class _Named(Protocol):
    model: str | None


def server_state(request: Request) -> ServerState:
    """The state the app was built around (api/app.py)."""
    state: ServerState = request.app.state.probserve
    return state


def serving_of(body_type: type[_Named]) -> Callable[..., Serving]:
    """The dependency giving the Serving of the model a `body_type` body names."""

    def lookup(request: Request, body: Any) -> Serving:
        state = server_state(request)
        if isinstance(body, BaseModel):
            names = unknown_fields(body)
            if names and state.config.strict_fields:
                raise refuse(names[0])
            if names:
                request.state.ignored_fields = names
                route = getattr(request.scope.get("route"), "path", "unmatched")
                state.metrics.ignored_fields.labels(route).inc(len(names))
        return state.serving(body.model)

    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
        inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body_type),
    ]
    lookup.__signature__ = inspect.Signature(params, return_annotation=Serving)  # type: ignore[attr-defined]
    return lookup
