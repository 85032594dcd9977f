"""Large answers as JSON, written without holding the event loop for long.

pydantic's serializer holds the GIL for all of one call: one `model_dump_json` of a chat answer
with 2300 prompt positions x 256 target ids stops the event loop for about a quarter of a second,
even from a worker thread. `dump_json` (run it `off_loop` for a large answer) writes a value a
piece at a time: no call into the serializer covers more than about `PIECE` values, and between
calls the interpreter hands the GIL to the event loop (every 5 ms: `sys.getswitchinterval`).
Its bytes are those of `model_dump_json`.
"""

from __future__ import annotations

from collections.abc import Collection

from pydantic import BaseModel
from pydantic_core import to_json

from probserve.api.protocol import TargetRow

PIECE = 2048  # values one serializer call may cover (a position's 256 targets: about 1000)


def dump_json(value: object) -> bytes:
    """`value` (a model, or lists and dicts of models and JSON values) as compact JSON."""
    out: list[bytes] = []
    _dump(value, out)
    return b"".join(out)


def _members(value: object) -> Collection[object] | None:
    if isinstance(value, BaseModel):
        return value.__dict__.values()
    if isinstance(value, list | tuple):
        return value
    if isinstance(value, dict):
        return value.values()
    return None


def _small(value: object) -> bool:
    """`value` holds at most PIECE values, nested ones included (counting stops past it)."""
    n, stack = 1, [value]
    while stack:
        value = stack.pop()
        if isinstance(value, TargetRow):  # written as its entries, one value each
            n += len(value)
            if n > PIECE:
                return False
            continue
        members = _members(value)
        if members:
            n += len(members)
            if n > PIECE:
                return False
            stack.extend(members)
    return True


def _entries(value: object) -> object:
    if isinstance(value, TargetRow):
        return value.entries()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _dump(value: object, out: list[bytes]) -> None:
    if _small(value):
        # inf_nan_mode: model_dump_json's default; a TargetRow outside a model: its entries
        out.append(to_json(value, inf_nan_mode="null", fallback=_entries))
    elif isinstance(value, BaseModel):
        sep = b"{"
        for name, field in type(value).model_fields.items():
            member = getattr(value, name)
            if field.exclude or (field.exclude_if is not None and field.exclude_if(member)):
                continue
            out += [sep, to_json(field.serialization_alias or name), b":"]
            _dump(member, out)
            sep = b","
        out.append(b"}" if sep == b"," else b"{}")
    elif isinstance(value, dict):
        sep = b"{"
        for key, member in value.items():
            out += [sep, to_json(str(key)), b":"]
            _dump(member, out)
            sep = b","
        out.append(b"}" if sep == b"," else b"{}")
    else:  # a list or tuple
        sep = b"["
        for member in value:  # type: ignore[attr-defined]
            out.append(sep)
            _dump(member, out)
            sep = b","
        out.append(b"]" if sep == b"," else b"[]")
