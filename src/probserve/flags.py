"""Settings declared once: a dataclass field with `setting(default, help)` is also the command
line flag of the same name (`max_num_seqs` -> `--max-num-seqs`), typed by its annotation and
default. A field without `setting` is no flag (the caller gives it to `from_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def setting(default: Any, help: str, metavar: str | None = None, positional: bool = False) -> Any:
    """A field whose flag is generated. bool: --x / --no-x; a Literal or an Enum: its choices;
    `X | None` (default None): an optional X; `tuple[X, ...]`: a flag given once per item
    (--model a --model b); anything else: the default's type. `positional`: a required
    argument (`probserve generate PROMPT`), not a flag."""
    meta = {"help": help, "metavar": metavar, "positional": positional}
    return dataclasses.field(default=default, metadata=meta)


def _flags(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _item_type(hint: Any) -> Any:
    """X of `X | None` or of `tuple[X, ...]`; the hint itself otherwise."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    if origin is tuple:
        return typing.get_args(hint)[0]
    return hint


def add_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per `setting` field of the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in _flags(cls):
        name = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        kw: dict[str, Any] = {"help": f.metadata["help"]}
        if f.metadata.get("positional"):
            parser.add_argument(f.name, type=hint, **kw)
            continue
        if f.metadata.get("metavar"):
            kw["metavar"] = f.metadata["metavar"]
        if hint is bool:
            parser.add_argument(
                name, action=argparse.BooleanOptionalAction, default=f.default, **kw
            )
            continue
        item = _item_type(hint)
        if typing.get_origin(hint) is tuple:
            kw.update(action="append", default=None)
        else:
            kw["default"] = f.default
        if typing.get_origin(item) is typing.Literal:
            kw["choices"] = typing.get_args(item)
        elif isinstance(item, type) and issubclass(item, enum.Enum):
            kw["choices"] = [m.value for m in item]
            kw["default"] = f.default.value if isinstance(f.default, enum.Enum) else f.default
        else:
            kw["type"] = item
        parser.add_argument(name, **kw)


def from_args(cls: type[T], args: argparse.Namespace, **rest: Any) -> T:
    """The dataclass `cls` built from the flags `add_args` declared (`rest`: its other fields)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in _flags(cls):
        value, hint = getattr(args, f.name), hints[f.name]
        item = _item_type(hint)
        if typing.get_origin(hint) is tuple:
            value = tuple(value) if value else f.default
        elif value is not None and isinstance(item, type) and issubclass(item, enum.Enum):
            value = item(value)
        values[f.name] = value
    return cls(**values, **rest)
