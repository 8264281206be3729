"""What a chat request asks beyond sampling and content: tools, tool calls in the history, and an output format,
checked (a schema's cost and satisfiability included) and turned into the decoder's contract."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from epd_common.errors import bad_request
from epd_contracts.generate import MAX_SCHEMA_BYTES, ResponseFormat, ToolChoice
from epd_contracts.limits import MAX_NAME_CHARS
from epd_contracts.schema_checks import MAX_SCHEMA_DEPTH, schema_cost_error, unsatisfiable

_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's pattern for function and json_schema names


class ToolCallFunction(BaseModel):
    name: str = Field(max_length=MAX_NAME_CHARS)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """An assistant turn's call, echoed back in the history (OpenAI's ChatCompletionMessageToolCall)."""

    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"]
    function: ToolCallFunction


class FunctionDef(BaseModel):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object; none: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]  # OpenAI's "custom" tools (free-form text input) are not implemented
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class FormatText(BaseModel):
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


AnyFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]
AnyToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _schema_fits(schema: dict[str, Any] | None, param: str) -> None:
    """Compiling a grammar is bounded by the schema's size and by the counts that drive its cost, and a schema no
    finite output matches is refused (epd_contracts/schema_checks.py): all before it reaches a decoder."""
    if schema is None:
        return
    try:  # the size first: measured at C speed, it bounds the walks below
        size = len(json.dumps(schema, separators=(",", ":")))
    except RecursionError:
        raise bad_request(f"{param}: the schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels", param,
                          code="schema_too_complex") from None
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"{param}: the schema is larger than {MAX_SCHEMA_BYTES} bytes as JSON", param,
                          code="invalid_request")
    if (why := schema_cost_error(schema)) is not None:
        raise bad_request(f"{param}: {why}", param, code="schema_too_complex")
    if (why := unsatisfiable(schema)) is not None:
        raise bad_request(f"{param}: {why}", param, code="unsatisfiable_schema")


@dataclass(frozen=True)
class Features:
    """What a chat request asks of the decoder beyond sampling: an output format, tools and how to use them."""

    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)


def response_format_of(fmt: FormatText | FormatJsonObject | FormatJsonSchema | None) -> ResponseFormat | None:
    """The contract's output format; a 400 for a schema too costly or that nothing matches."""
    if isinstance(fmt, FormatJsonObject) or (isinstance(fmt, FormatJsonSchema) and fmt.json_schema.schema_ is None):
        return ResponseFormat(type="json_object")  # a json_schema without a schema: any JSON object
    if isinstance(fmt, FormatJsonSchema):
        _schema_fits(fmt.json_schema.schema_, "response_format")
        return ResponseFormat(type="json_schema", json_schema=fmt.json_schema.schema_,
                              strict=bool(fmt.json_schema.strict))
    return None


def features_of(fmt: FormatText | FormatJsonObject | FormatJsonSchema | None, tools: list[Tool] | None,
                choice: AnyToolChoice | None, parallel_tool_calls: bool | None) -> Features:
    """response_format, tools and tool_choice as the contract; a 400 naming the field they break."""
    response_format = response_format_of(fmt)
    tools = tools or []
    for i, tool in enumerate(tools):
        _schema_fits(tool.function.parameters, f"tools.{i}.function.parameters")
    names = {t.function.name for t in tools}
    choice = choice if choice is not None else ("auto" if tools else "none")
    if not tools and choice != "none":
        raise bad_request("tool_choice: only allowed when tools are specified", "tool_choice", code="invalid_request")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice: no function named {choice.function.name!r} in tools", "tool_choice",
                          code="invalid_request")
    parallel = parallel_tool_calls is not False
    tool_choice = ToolChoice(mode="function", name=choice.function.name, parallel=parallel) \
        if isinstance(choice, NamedToolChoice) else ToolChoice(mode=choice, parallel=parallel)
    return Features(response_format, [t.model_dump(exclude_none=True) for t in tools], tool_choice)
