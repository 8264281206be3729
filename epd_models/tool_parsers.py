"""Tool formats by model family: how a family's model writes tool calls, and so how to parse and constrain them.

`tool_format(model_type)` picks one; Hermes/Qwen (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`)
serves every family registered here and any unknown one. Another family's format is a ToolFormat given to
`register`. Torch-free and stateless: a ToolFormat is shared by every request, a ToolParser belongs to one choice.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from epd_contracts.generate import ToolChoice
from epd_models import tool_prompt
from epd_models.guide_spec import GuideSpec, canonical
from epd_models.tool_stream import ParsedDelta, TaggedParser, ToolParser

__all__ = ["HERMES", "HermesFormat", "ParsedDelta", "ToolFormat", "ToolParser", "function_of", "register",
           "tool_format"]

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolFormat(ABC):
    """A family's tool-call text: parsing the model's output, constraining it, and writing it into a prompt."""

    @abstractmethod
    def parser(self) -> ToolParser:
        """A fresh streaming parser for one choice."""

    @abstractmethod
    def guide(self, tools: list[dict[str, Any]], choice: ToolChoice) -> GuideSpec | None:
        """The constraint for `choice`: required / a named function constrain the output; auto / none: None.

        Raises:
            ValueError: the named function is not among `tools`, or a tool is not a function (the caller's 400).
        """

    @abstractmethod
    def system_prompt(self, tools: list[Any]) -> str:
        """The tools block for a chat template that ignores `tools`."""

    @abstractmethod
    def call_text(self, name: Any, arguments: Any) -> str:
        """One assistant call as the model writes it, for a template that cannot render `tool_calls`."""

    @abstractmethod
    def results_text(self, contents: list[Any]) -> list[Any]:
        """Consecutive tool results as the pieces of one user turn (strings, or lists of content parts)."""

    call_separator: str = "\n"  # between two calls of one assistant turn (and after its content)


class HermesFormat(ToolFormat):
    """Qwen2/2.5 and Hermes: each call a JSON object in <tool_call> tags, results in <tool_response> tags."""

    def parser(self) -> ToolParser:
        return TaggedParser(tool_prompt.CALL_BEGIN.strip(), tool_prompt.CALL_END.strip())

    def guide(self, tools: list[dict[str, Any]], choice: ToolChoice) -> GuideSpec | None:
        if choice.mode in ("none", "auto"):
            return None
        functions = [function_of(t) for t in tools]
        if choice.mode == "function":
            functions = [f for f in functions if f["name"] == choice.name]
            if not functions:
                raise ValueError(f"tool_choice names function {choice.name[:64]!r}, which is not among the tools")
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one tool")
        schema = {"anyOf": [{"type": "object",
                             "properties": {"name": {"const": f["name"]},
                                            "arguments": f.get("parameters", _NO_PARAMETERS)},
                             "required": ["name", "arguments"],
                             "additionalProperties": False} for f in functions]}  # the call object itself is closed
        return GuideSpec(kind="tool_calls", schema=canonical(schema), begin=tool_prompt.CALL_BEGIN,
                         end=tool_prompt.CALL_END, separator=tool_prompt.CALL_SEPARATOR, min_items=1,
                         max_items=None if choice.parallel else 1)

    def system_prompt(self, tools: list[Any]) -> str:
        return tool_prompt.system_prompt(tools)

    def call_text(self, name: Any, arguments: Any) -> str:
        return tool_prompt.call_text(name, arguments)

    def results_text(self, contents: list[Any]) -> list[Any]:
        pieces: list[Any] = []
        for k, content in enumerate(contents):
            sep = tool_prompt.RESULT_SEPARATOR if k else ""
            pieces += [sep + tool_prompt.RESULT_BEGIN, content, tool_prompt.RESULT_END]
        return pieces


def function_of(tool: Any) -> dict[str, Any]:
    """The `function` of an OpenAI tool, checked: a dict with a non-empty string name (else ValueError)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function":
        raise ValueError("each tool must be {\"type\": \"function\", \"function\": {...}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError("each tool's function needs a non-empty string name")
    if not isinstance(function.get("parameters", {}), dict):
        raise ValueError(f"the parameters of tool {function['name'][:64]!r} must be a JSON Schema object")
    return function


HERMES = HermesFormat()
_FORMATS: dict[str, ToolFormat] = {"qwen2_vl": HERMES, "qwen2_5_vl": HERMES, "llava": HERMES}


def register(model_type: str, fmt: ToolFormat) -> None:
    """Use `fmt` for checkpoints whose config.json has this model_type (at start-up, before serving)."""
    _FORMATS[model_type] = fmt


def tool_format(model_type: str) -> ToolFormat:
    """The family's tool format; Hermes/Qwen for a family nobody registered."""
    return _FORMATS.get(model_type, HERMES)
