"""A request's `keep_alive` (Ollama's meaning): how long an on-demand model stays loaded after
the request ends. Seconds as a number (or a string of one: "30", "-1"), or a duration string
in Go's syntax ("5m", "1h30m", "90s", "-1m"); 0 unloads the model once the request has
ended, a negative value keeps it loaded until it is evicted or unloaded. Anything else is a
400 naming `keep_alive`."""

from __future__ import annotations

import math
import re

from probserve.api.errors import APIError, bad_request

FOREVER = math.inf  # a negative keep_alive: never unloaded for idleness
MAX_TEXT = 64  # characters a duration string may hold

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}  # fmt: skip
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def _refused(value: object) -> APIError:
    shown = repr(value)[:80]
    return bad_request(
        f"keep_alive must be a number of seconds or a duration such as '5m' or '1h30m' "
        f"(0: unload after this request; negative: keep loaded); got {shown}",
        "keep_alive",
    )


def _duration(text: str) -> float:
    """Seconds of a Go duration string ("1h30m", "-5m", "0"); ValueError if it is not one."""
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body[1:] if body[:1] in ("-", "+") else body
    if _NUMBER.fullmatch(body):  # seconds
        return sign * float(body)
    seconds, at = 0.0, 0
    while at < len(body):
        part = _PART.match(body, at)
        if part is None:
            raise ValueError(text)
        seconds += float(part.group(1)) * _UNITS[part.group(2)]
        at = part.end()
    if at == 0:
        raise ValueError(text)
    return sign * seconds


def keep_alive_seconds(value: object) -> float | None:
    """The seconds `value` asks a model to stay loaded after its request (FOREVER for a
    negative value); None where the request gave none. A 400 naming `keep_alive` for anything
    that is not a finite number or a duration string."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _refused(value)
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            raise _refused(value) from None
    elif isinstance(value, str) and len(value) <= MAX_TEXT:
        try:
            seconds = _duration(value)
        except ValueError:
            raise _refused(value) from None
    else:
        raise _refused(value)
    if not math.isfinite(seconds):
        raise _refused(value)
    return FOREVER if seconds < 0 else seconds
