"""The field policy: what happens to a request's fields this server does not implement.

Never silently ignored. By default (what lm-evaluation-harness, the OpenAI SDK's `extra_body`
and other servers' clients need) such a field is accepted and named back: the response's
`X-Ignored-Fields` header lists them, the access line carries them, and
`probserve:ignored_fields_total` counts them. With `--strict-fields` the first one is a 400
(`unknown_parameter`, naming it), as OpenAI answers. Parsing has already refused an object
with more than `MAX_UNKNOWN` of them (api/protocol.py), so a request holds a bounded number.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel

from probserve.api.errors import APIError

MOST_NAMED = 32  # names kept for the header and the log line (the count is exact)


def _walk(value: object, path: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        for key in value.model_extra or ():
            yield f"{path}.{key}" if path else str(key)
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel | list | tuple):
                yield from _walk(item, f"{path}[{i}]")


def unknown_fields(body: BaseModel) -> list[str]:
    """The paths of every field of `body`, nested objects included, that no model declares
    (`messages[0].content[1].cache_control`), in the order they came."""
    return list(_walk(body, ""))


def refuse(name: str) -> APIError:
    return APIError(
        400,
        f"{name} is not a field this server implements (docs/operations.md, 'Unknown fields')",
        name,
        "unknown_parameter",
    )


def header_value(names: list[str]) -> str:
    """The names as one header value: printable ASCII (other characters escaped), at most
    MOST_NAMED of them and 2 KB."""
    text = ", ".join(names[:MOST_NAMED])
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return text[:2048]
