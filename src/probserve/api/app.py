"""The FastAPI application: routes, error envelopes, middleware, engine lifecycle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from probserve import __version__
from probserve.api.edge.middleware import (
    OPEN_PATHS,
    AccessLogMiddleware,
    AuthMiddleware,
    BodyLimitMiddleware,
    ScopeGuardMiddleware,
)
from probserve.api.errors import install_error_handlers
from probserve.api.routes import (
    chat,
    completions,
    distributions,
    embeddings,
    messages,
    misc,
    model_loading,
    playground,
    rerank,
    responses,
    score,
)
from probserve.api.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for model in state.models:
            model.engine.start()
        try:
            yield
        finally:
            for model in state.models:
                model.engine.stop()

    app = FastAPI(title="probserve", version=__version__, lifespan=lifespan)
    app.state.probserve = state
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(score.router)
    app.include_router(rerank.router)
    app.include_router(embeddings.router)
    app.include_router(distributions.router)
    app.include_router(playground.router)
    app.include_router(misc.router)
    app.include_router(model_loading.router)
    install_error_handlers(app)
    limits = state.config.http
    # the last added runs first: scope guard, access log, CORS (where origins are allowed:
    # before auth, so a browser's preflight, which carries no key, is answered), auth, body
    # limits, then the routes
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout
    )
    open_paths = OPEN_PATHS | playground.PATHS  # the page is open; its calls need the key
    open_paths |= {"/metrics"} if state.config.open_metrics else set()
    app.add_middleware(AuthMiddleware, keys=state.config.api_keys, open_paths=open_paths)
    if state.config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
    app.add_middleware(AccessLogMiddleware, on_response=state.metrics.observe_http)
    app.add_middleware(ScopeGuardMiddleware)
    return app
