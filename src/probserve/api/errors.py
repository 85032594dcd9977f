"""Errors in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}; on the
Messages API's paths (ANTHROPIC_PATHS) in Anthropic's, which holds the same fields:
{"type": "error", "error": {"type", "message", "param", "code"}}, with Anthropic's type names."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from probserve.api.protocol import ErrorResponse
from probserve.engine import EngineDead, EngineOverloaded, RequestError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


# Anthropic's error types, by status (docs.claude.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

ANTHROPIC_PATHS = "/v1/messages"  # and what lies under it (count_tokens)


def anthropic_path(path: str) -> bool:
    """Whether `path` is the Messages API's, whose errors are in Anthropic's envelope."""
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


# the error statuses a route may answer, for its OpenAPI description
ERRORS: dict[int | str, dict] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def _printable(text: str | None) -> str | None:
    """A client's text quoted in an error (a field name, a model) may hold lone surrogates,
    which JSON responses cannot carry: they are escaped (\\ud800)."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    status: int, message: str, param: str | None, code: str | None, anthropic: bool = False
) -> dict:
    types = _ANTHROPIC_TYPES if anthropic else _TYPES
    error = {
        "message": _printable(message),
        "type": types.get(status, "invalid_request_error"),
        "param": _printable(param),
        "code": code,
    }
    return {"type": "error", "error": error} if anthropic else {"error": error}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    anthropic: bool = False,
) -> JSONResponse:
    body = error_body(status, message, param, code, anthropic)
    return JSONResponse(body, status, headers=headers)


def _param_from_loc(loc: tuple) -> str | None:
    # the location's kind first (a body field may be called "query": /v1/score's is)
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    parts = [str(p) for p in loc]
    # drop pydantic's union-member tags such as "str", "list[int]" or a model's name ("TextPart":
    # no field's name begins with a capital)
    parts = [
        p
        for p in parts
        if not (p[:1].isalpha() and ("[" in p or p in _TYPE_TAGS or p[0].isupper()))
    ]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after"}


def _refused(
    request: Request,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The error response, with what it says kept for the request's access line."""
    request.state.error = (code or _TYPES.get(status, "error"), _printable(param),
                           _printable(message))  # fmt: skip
    return error_response(status, message, param, code, headers, anthropic_path(request.url.path))


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    # in a union (a prompt is text, texts or ids), the member whose own check failed says
    # most: a value error (a lone surrogate, say) or a list past its parse-time bound over
    # "should be a valid string"
    first = next((e for e in errors if e.get("type") in _TELLING), None)
    first = first or (errors[0] if errors else {})
    param = _param_from_loc(tuple(first.get("loc", ())))
    named = (first.get("ctx") or {}).get("param")  # an object's check names its field
    if named is not None:
        param = f"{param}.{named}" if param else str(named)
    msg = first.get("msg", "invalid request")
    kind = first.get("type")
    if kind == "json_invalid":
        return _refused(request, 400, f"the request body is not valid JSON: {msg}")
    if kind == "too_many_unknown_fields":
        return _refused(request, 400, msg, param, "unknown_parameter")
    where = f" ({param})" if param else ""
    return _refused(request, 400, f"{msg}{where}", param)


# the errors that say most in a union: a member's own check, not "should be a valid string"
_TELLING = ("value_error", "too_long", "too_many_unknown_fields", "field_conflict")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _refused(request, exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestError)
    async def _engine_request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _refused(request, 400, str(exc), exc.param)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(request: Request, exc: EngineOverloaded) -> JSONResponse:
        return _refused(request, 429, str(exc), None, "overloaded", {"Retry-After": "1"})

    @app.exception_handler(EngineDead)
    async def _dead(request: Request, exc: EngineDead) -> JSONResponse:
        return _refused(request, 503, str(exc), None, "engine_dead")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _refused(request, exc.status_code, str(exc.detail), None, None, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _refused(request, 500, f"internal error: {type(exc).__name__}")
