"""POST /models/load and POST /models/unload (llama-server's router paths; behind the API
key): load a model served on demand now, or unload it (its requests in flight finish first).
Only the names this server serves are known: any other name or path is a 404 and nothing is
read. A pinned model (--model) is always loaded and cannot be unloaded (400)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from probserve.api.errors import ERRORS, bad_request
from probserve.api.protocol.models import ModelLoadRequest, ModelLoadResponse
from probserve.api.server.lookup import field_policy, server_state
from probserve.api.server.state import ServerState

router = APIRouter()


def _on_demand_name(st: ServerState, name: str, unloading: bool) -> bool:
    """Whether `name` is a model on demand (else a pinned one: True/False); a 404 for a name
    this server does not serve, a 400 for unloading a pinned model."""
    if st.on_demand is not None and name in st.on_demand.entries:
        return True
    st.model(name)  # a 404 for an unknown name
    if unloading:
        raise bad_request(f"the model `{name}` is pinned (--model): it is never unloaded", "model")
    return False


@router.post("/models/load", response_model=ModelLoadResponse, responses=ERRORS)
async def load(body: ModelLoadRequest, request: Request) -> ModelLoadResponse:
    """The model loaded (returns once it serves; a 503 naming the reason where it fails)."""
    st = server_state(request)
    field_policy(request, st, body)
    if not body.model:
        raise bad_request("name the model to load", "model")
    if not _on_demand_name(st, body.model, unloading=False):
        return ModelLoadResponse(model=body.model, state="loaded", pinned=True)
    assert st.on_demand is not None
    entry = await st.on_demand.load(body.model)
    return ModelLoadResponse(model=entry.name, state=entry.state)


@router.post("/models/unload", response_model=ModelLoadResponse, responses=ERRORS)
async def unload(body: ModelLoadRequest, request: Request) -> ModelLoadResponse:
    """The model unloaded (returns once its requests in flight have ended and its worker has
    stopped)."""
    st = server_state(request)
    field_policy(request, st, body)
    if not body.model:
        raise bad_request("name the model to unload", "model")
    _on_demand_name(st, body.model, unloading=True)
    assert st.on_demand is not None
    entry = await st.on_demand.unload(body.model)
    # success false: a request named it again meanwhile, and it loads or serves again
    done = entry.state in ("unloaded", "failed")
    return ModelLoadResponse(success=done, model=entry.name, state=entry.state)
