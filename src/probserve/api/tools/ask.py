"""What a request asks of tools: the functions it offers, whether the model may, must or must
not call them (`tool_choice`), and how many calls a reply may hold (`parallel_tool_calls`),
checked against each other before anything else is done."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from probserve.api.errors import bad_request
from probserve.api.protocol import FunctionDefinition, NamedToolChoice, ToolChoice
from probserve.api.structured import closed_objects
from probserve.api.tools.formats import ToolFormat, ToolParser


@dataclass(frozen=True)
class ToolAsk:
    """`functions`: the tools offered; `choice`: "auto", "required", or "named" (`named` must
    be called; "none" never gets here: the tools are kept out); `parallel`: a reply may hold
    several calls; `fmt`: how this model writes calls; `closed`: a call's arguments take no
    keys their schema does not name, unless it says additionalProperties (`schemas`: each
    function's arguments schema as a call must follow it)."""

    functions: tuple[FunctionDefinition, ...]
    choice: Literal["auto", "required", "named"]
    parallel: bool
    fmt: ToolFormat
    named: str | None = None
    prime: bool = True  # the prompt may hold the reply's certain start (`primer`)
    closed: bool = True
    schemas: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schemas = []
        for f in self.functions:
            schema = f.parameters if f.parameters is not None else NO_ARGUMENTS
            schemas.append(closed_objects(schema) if self.closed else schema)
        object.__setattr__(self, "schemas", tuple(schemas))

    @property
    def forced(self) -> bool:
        """The reply must be calls (required, or a named function)."""
        return self.choice != "auto"

    @property
    def primer(self) -> str:
        """What the reply is sure to begin with, written into the prompt so it costs no
        `max_tokens` (the model continues it): for a generic-format reply that must be calls,
        the wrapper up to the function's name (`required`) or its arguments (a named function).
        Native formats and "auto" have none."""
        if self.fmt.parser is not ToolParser.GENERIC or not self.forced or not self.prime:
            return ""
        if self.choice == "named":
            return f'{{"tool_calls": [{{"name": {json.dumps(self.named)}, "arguments": '
        return '{"tool_calls": [{"name": "'

    @property
    def most_calls(self) -> int | None:
        """The most calls a reply may hold (None: no bound)."""
        return None if self.parallel and self.choice != "named" else 1

    @property
    def offered(self) -> tuple[FunctionDefinition, ...]:
        """The functions a call may name (a named choice: that one)."""
        return tuple(f for f, _ in self.offered_schemas)

    @property
    def offered_schemas(self) -> tuple[tuple[FunctionDefinition, Any], ...]:
        """The functions a call may name, each with its arguments' schema (`schemas`)."""
        pairs = tuple(zip(self.functions, self.schemas, strict=True))
        if self.choice != "named":
            return pairs
        return tuple((f, s) for f, s in pairs if f.name == self.named)

    @property
    def strict(self) -> bool:
        """Some function asks for its arguments to follow its schema."""
        return any(f.strict for f in self.functions)


# a function without `parameters` takes none: its arguments are "{}" (docs/tools.md)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_ask(
    functions: list[FunctionDefinition] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    fmt: ToolFormat,
    closed: bool = True,
) -> ToolAsk | None:
    """None: no tools for this reply (none offered, or tool_choice "none"). `closed`: the
    server's schema_extra_keys is forbid (ToolAsk.closed)."""
    if not functions:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        if parallel is not None:
            raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"two tools are named {dup!r}", "tools")
    for i, f in enumerate(functions):
        if f.parameters is not None and not isinstance(f.parameters, dict):
            raise bad_request(
                "a function's parameters must be a JSON schema (an object)",
                f"tools[{i}].function.parameters",
            )
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return ToolAsk(tuple(functions), "named", parallel is not False, fmt, name, closed=closed)
    return ToolAsk(tuple(functions), choice or "auto", parallel is not False, fmt, closed=closed)


def made_once(made: set[str], call_id: str, call: str, param: str) -> None:
    """A call an earlier message made, added to `made`: its id names it alone (a result
    answers one call), so an id made twice in one conversation is a 400, as Anthropic's
    API answers it (`call`: the request's name for a call, "tool_use block")."""
    if call_id in made:
        raise bad_request(f"{call} id {call_id!r} is not unique: an earlier call has it", param)
    made.add(call_id)


def check_answers(made: set[str], call_id: str, result: str, call: str, param: str) -> None:
    """A tool's result sent back answers a call an earlier message made: `result` and `call`
    are the request's names for the two ("tool_result answers tool_use_id ...")."""
    if call_id not in made:
        raise bad_request(f"{result} answers {call_id!r}, which no earlier {call} made", param)
