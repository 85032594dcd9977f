"""Settings declared once: a dataclass field with `setting(default, help)` is also the command
line flag of the same name (`max_num_seqs` -> `--max-num-seqs`), typed by its default."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def setting(default: Any, help: str) -> Any:
    """A field whose flag is generated: its type is the default's (bool: --x / --no-x; a
    Literal annotation: its choices)."""
    return dataclasses.field(default=default, metadata={"help": help})


def add_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help")
        if isinstance(f.default, bool):
            parser.add_argument(
                name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
            continue
        choices = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is typing.Literal:
            parser.add_argument(name, choices=choices, default=f.default, help=help_text)
        else:
            parser.add_argument(name, type=type(f.default), default=f.default, help=help_text)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass `cls` built from the flags `add_args` declared."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
