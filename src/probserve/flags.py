"""Settings declared once: a dataclass field with `setting(default, help)` is also the command
line flag of the same name (`max_num_seqs` -> `--max-num-seqs`), typed by its annotation and
default, shown under its group in `--help` with its default. A field without `setting` is no
flag (the caller gives it to `from_args`).

Presets come before the command line (`presets`): a YAML file of flags (`--config`), then
`PROBSERVE_<FLAG>` environment variables; the command line wins over both, the environment
over the file."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "PROBSERVE_"


def setting(
    default: Any,
    help: str,
    metavar: str | None = None,
    positional: bool = False,
    group: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A field whose flag is generated. bool: --x / --no-x; a Literal or an Enum: its choices;
    `X | None` (default None): an optional X; `tuple[X, ...]`: a flag given once per item
    (--model a --model b); anything else: the default's type. `positional`: a required
    argument (`probserve generate PROMPT`), not a flag. `group`: its heading in --help (else
    the one add_args is given); `aliases`: other spellings of the flag (vLLM's)."""
    meta = {
        "help": help,
        "metavar": metavar,
        "positional": positional,
        "group": group,
        "aliases": aliases,
    }
    return dataclasses.field(default=default, metadata=meta)


class PresetError(ValueError):
    """A preset (the --config file's entry, a PROBSERVE_ variable) that is no flag's value."""


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class HelpFormatter(argparse.HelpFormatter):
    """--help with each flag's default (none where it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS, ()) or "%(default)" in text:
            return text
        if action.option_strings:
            text += " (default: %(default)s)"
        return text


class FlagGroups:
    """The headings of a parser's --help, one argument group a title, made on first use."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.groups: dict[str, argparse._ArgumentGroup] = {}

    def __call__(self, title: str | None) -> argparse._ArgumentGroup | argparse.ArgumentParser:
        if title is None:
            return self.parser
        if title not in self.groups:
            self.groups[title] = self.parser.add_argument_group(title)
        return self.groups[title]


def _enum_value(cls: type[enum.Enum]) -> Any:
    def value(text: str) -> Any:
        try:
            return cls(text).value
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not one of {', '.join(str(m.value) for m in cls)}"
            ) from None

    return value


def add_args(
    parser: argparse.ArgumentParser,
    cls: type,
    group: str | None = None,
    groups: FlagGroups | None = None,
) -> None:
    """One flag per `setting` field of the dataclass `cls`, under the field's group or `group`."""
    hints = typing.get_type_hints(cls)
    groups = groups or FlagGroups(parser)
    for f in _flags(cls):
        name = _flag(f.name)
        names = (name, *f.metadata.get("aliases", ()))
        hint = hints[f.name]
        where = groups(f.metadata.get("group") or group)
        kw: dict[str, Any] = {"help": f.metadata["help"]}
        if f.metadata.get("positional"):
            where.add_argument(f.name, type=hint, **kw)
            continue
        kw["dest"] = f.name
        if f.metadata.get("metavar"):
            kw["metavar"] = f.metadata["metavar"]
        if hint is bool:
            where.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=f.default, **kw
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
            kw["type"] = _enum_value(item)  # the enum's other spellings (its _missing_) too
            kw["default"] = f.default.value if isinstance(f.default, enum.Enum) else f.default
        else:
            kw["type"] = item
        where.add_argument(*names, **kw)


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


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _tokens(name: str, hint: Any, value: Any, where: str) -> list[str]:
    """The command-line tokens that give flag `name` the preset `value` (a YAML value, or an
    environment variable's string)."""
    flag = _flag(name)
    if hint is bool:
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            value = value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise PresetError(f"{where}: {value!r} is not true or false")
        return [flag if value else "--no-" + flag[2:]]
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            items: Sequence[Any] = [v for v in value.split(",") if v.strip()]
        elif isinstance(value, list):
            items = value
        else:
            items = [value]
        return [t for v in items for t in (flag, _scalar(v, where))]
    if value is None:
        return []
    return [flag, _scalar(value, where)]


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, (dict, list)):
        raise PresetError(f"{where}: {value!r} is not one value")
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def presets(
    classes: Sequence[type],
    argv: Sequence[str],
    environ: Mapping[str, str],
    file_values: Mapping[str, Any] | None = None,
) -> list[str]:
    """The tokens to put before `argv` so that the flags of `classes` take their values from
    `file_values` (the --config file's keys, spelled as the flag or its field), then from
    `PROBSERVE_<FIELD>` variables of `environ`; a flag `argv` gives keeps only argv's value (a
    repeatable flag too: argv's items replace the presets', never add to them). A key of the
    file that is no flag is a PresetError; other PROBSERVE_ variables are not flags and are
    left alone."""
    fields: dict[str, Any] = {}  # field name -> its type
    spellings: dict[str, str] = {}  # --flag, --no-flag and the aliases' -> field name
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in _flags(cls):
            if f.metadata.get("positional"):
                continue
            fields[f.name] = hints[f.name]
            for flag in (_flag(f.name), *f.metadata.get("aliases", ())):
                spellings[flag] = spellings["--no-" + flag[2:]] = f.name
    given = {spellings[t.split("=", 1)[0]] for t in argv if t.split("=", 1)[0] in spellings}
    chosen: dict[str, tuple[Any, str]] = {}
    for key, value in (file_values or {}).items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in fields:
            raise PresetError(f"the --config file's {key!r} is no flag of this command")
        chosen[name] = (value, f"the --config file's {key!r}")
    for name in fields:
        variable = ENV_PREFIX + name.upper()
        if variable in environ:
            chosen[name] = (environ[variable], variable)
    out: list[str] = []
    for name, (value, where) in chosen.items():
        if name not in given:
            out += _tokens(name, fields[name], value, where)
    return out
