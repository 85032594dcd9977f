"""The protocol models' common ground: parse-time bounds, shared field types (bounded lists,
strict numbers, UTF-8 text, bounded JSON), the request base class and its field policy
(`RequestModel`), usage, extensions and errors. Every API's models (one module each beside this)
build on it.

Field names and types follow OpenAI's API reference. Vendor fields vLLM users send are accepted
too (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, logprobs_mode,
prompt_logprobs, skip_special_tokens, structured_outputs and the older guided_*), and another
server's spelling of a field with the same meaning is taken as that field (`_Request.renamed`:
max_new_tokens, min_new_tokens). A field this server does not implement is kept in the model's
extras, never silently ignored: api/server/fields.py names it back (a header, the access line, a
counter), or refuses it with --strict-fields (docs/operations.md, "Unknown fields").
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    model_validator,
)
from pydantic_core import PydanticCustomError

# the range of a 64-bit signed integer: seeds and other integers past it are a 400
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Parse-time bounds (docs/operations.md, "Parse-time bounds"): the most entries any list or map
# of a request may hold. pydantic counts a list's items as it validates them and `fail_fast`
# ends a list at its first bad item (one error, not one per item), so a list past its bound
# costs at most bound + 1 item checks and one error, whatever its length or its items' types.
# They are fixed ceilings above the runtime limits (api/server/limits.py, checked after parsing): a
# limit flag set past its ceiling has no effect beyond it.
MAX_IDS = 2**20  # token ids in one prompt, query, item or /detokenize call
MAX_ITEMS = 4096  # prompts, items, messages, content parts, stop strings and ids, target and
# label ids, positions, logit_bias entries
MAX_FEW = 64  # include, tools, metadata, text, chat_template_kwargs keys
MAX_JSON_VALUES = 10_000  # values in all of chat_template_kwargs, nested ones included
MAX_UNKNOWN = 16  # fields one object may hold that this server does not implement


def _utf8(text: str) -> str:
    """Reject strings that cannot be encoded as UTF-8 (JSON escapes of lone surrogates such as
    "\\ud800"): no tokenizer, template or response could carry them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the string holds a lone surrogate (U+{ord(text[exc.start]):04X}), which is not "
            "valid Unicode"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


def _no_bool(value: Any) -> Any:
    """JSON's true and false are no numbers to a client (pydantic would take them as 1 and 0):
    a 400 naming the field, whose message says so."""
    if isinstance(value, bool):
        raise ValueError(f"{json.dumps(value)} is a boolean, not a number")
    return value


# A request's numbers, strictly: an integer field takes a JSON integer (true, false, 2.0 and
# "2" are a 400 naming it, as OpenAI answers them), a number field a JSON number (an integer
# or not; true, false and "0.5" are a 400)
Int = Annotated[int, Strict(), BeforeValidator(_no_bool)]
Float = Annotated[float, Strict(), BeforeValidator(_no_bool)]

MAX_JSON_DEPTH = 32  # nesting of any JSON value a request holds, or a JSON text it holds


def _depth_within(value: Any, most: int) -> bool:
    """Whether `value` nests at most `most` levels (iterative: any depth is safe to ask)."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > most:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


def json_text(text: str) -> str:
    """A string a request's server may parse as JSON (a call's arguments, a tool's result, a
    schema as text): if it is JSON, nested at most MAX_JSON_DEPTH deep. Text that is not JSON
    is left as it is (a model's malformed arguments, a plain result)."""
    if text.lstrip()[:1] not in ("{", "["):
        return text
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(
            f"the JSON text is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    except ValueError:
        return text
    if not _depth_within(value, MAX_JSON_DEPTH):
        raise ValueError(f"the JSON text is nested more than {MAX_JSON_DEPTH} levels deep")
    return text


JsonText = Annotated[str, AfterValidator(_utf8), AfterValidator(json_text)]


def json_utf8(value: Any, depth: int = 0, seen: list[int] | None = None) -> Any:
    """Every string (keys included) of a JSON value is valid Unicode, nesting at most 32 deep,
    at most MAX_JSON_VALUES values in all."""
    seen = [0] if seen is None else seen
    if depth == 0 and isinstance(value, str):  # a schema given as JSON text
        json_text(value)
    seen[0] += 1
    if seen[0] > MAX_JSON_VALUES:
        raise ValueError(f"the value holds more than {MAX_JSON_VALUES} values")
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"the value is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        _utf8(value)
    elif isinstance(value, list):
        for v in value:
            json_utf8(v, depth + 1, seen)
    elif isinstance(value, dict):
        for k, v in value.items():
            _utf8(k)
            json_utf8(v, depth + 1, seen)
    return value


def bounded(most: int) -> Any:
    """A list of at most `most` items, refused while it is parsed, at its first bad item."""
    return Field(max_length=most, fail_fast=True)


def entries(most: int) -> Any:
    """A map of at most `most` entries, counted before any entry is validated (pydantic checks
    a dict's length only after validating every entry, with one error per bad one)."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > most:
            raise ValueError(f"at most {most} entries (got {len(value)})")
        return value

    return BeforeValidator(check)


Ids = Annotated[list[Int], bounded(MAX_IDS)]  # a prompt's token ids
IdLists = Annotated[list[Ids], bounded(MAX_ITEMS)]
Texts = Annotated[list[Text], bounded(MAX_ITEMS)]
ShortIds = Annotated[list[Int], bounded(MAX_ITEMS)]  # stop, target and label ids, positions


class RequestModel(BaseModel):
    """A request object. JSON's non-standard NaN/Infinity literals are refused: every float is
    finite. A field this server does not implement is kept in `model_extra` (api/server/fields.py
    names it back or refuses it); more than MAX_UNKNOWN of them in one object is a 400 before
    any field is validated, so a body of 300,000 unknown keys costs one pass over its keys."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    # another server's name for one of this object's fields, with the same meaning
    renamed: ClassVar[dict[str, str]] = {}
    # an older name of this API's for one of its fields (chat's max_tokens for
    # max_completion_tokens): both fields are kept, and given together they must agree
    older: ClassVar[dict[str, str]] = {}
    _known: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        names = {n for n, f in cls.model_fields.items()} | {
            f.alias for f in cls.model_fields.values() if f.alias
        }
        cls._known = frozenset(names | set(cls.renamed))

    @model_validator(mode="before")
    @classmethod
    def _fields_first(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = 0
        for key in data:
            if key not in cls._known:
                unknown += 1
                if unknown > MAX_UNKNOWN:
                    raise PydanticCustomError(
                        "too_many_unknown_fields",
                        "the object holds more than {most} fields this server does not "
                        "implement (the 17th: {param})",
                        {"most": MAX_UNKNOWN, "param": str(key)[:64]},
                    )
        renamed = [k for k in cls.renamed if k in data]
        given: dict[str, str] = {}  # a field -> another server's name it was given under
        if renamed:
            data = dict(data)
        for other in renamed:
            ours = cls.renamed[other]
            value = data.pop(other)
            if ours in data and data[ours] != value:
                raise conflict(other, ours)
            data[ours] = value
            given[ours] = other
        for old, ours in cls.older.items():
            both = data.get(old) is not None and data.get(ours) is not None
            if both and data[old] != data[ours]:
                if ours in given:  # given under another server's name: that one is named
                    raise conflict(given[ours], old)
                raise conflict(old, ours)
        return data


def conflict(param: str, ours: str) -> PydanticCustomError:
    """Two names of one field given different values: a 400 naming `param` (the other name)."""
    return PydanticCustomError(
        "field_conflict",
        "{param} is another name for {ours}, and the two disagree",
        {"param": param, "ours": ours},
    )


JsonValue = Annotated[Any, AfterValidator(json_utf8)]  # bounded in size and depth


def absent(value: object) -> bool:
    return value is None


def Extension(default: Any = None) -> Any:
    """A field of probserve's own: left out of the JSON unless the request asked for it."""
    return Field(default, exclude_if=absent)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's: of the prompt tokens, those the prefix cache held (not computed again)
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    # OpenAI's: of the completion tokens, a thinking model's reasoning's (only where it thinks)
    completion_tokens_details: dict[str, int] | None = Extension()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": cached_tokens},
        )


def now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
