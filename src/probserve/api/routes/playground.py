"""The playground page: GET /playground (and / redirects there), static files shipped in the
package, no CDN, no build step. The page itself is open; its API calls stay behind the key."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response
from starlette.exceptions import HTTPException

router = APIRouter(include_in_schema=False)

PATHS = frozenset({"/", "/playground", "/playground/playground.js", "/playground/playground.css"})
_TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css"}


@cache
def _read(name: str) -> bytes:
    return (resources.files("probserve.api") / "static" / name).read_bytes()


def _file(name: str) -> Response:
    kind = _TYPES[name.rsplit(".", 1)[1]]
    return Response(_read(name), media_type=f"{kind}; charset=utf-8")


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/playground")


@router.get("/playground")
async def page() -> Response:
    return _file("playground.html")


@router.get("/playground/{name}")
async def asset(name: str) -> Response:
    if name not in ("playground.js", "playground.css"):
        raise HTTPException(404)  # the envelope, as for any unknown path
    return _file(name)
