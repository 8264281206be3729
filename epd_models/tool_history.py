"""Tools and tool history for a chat template: what it can render itself, and the family's text for the rest.

A ToolPlan is chosen once per request by rendering the sentinel-marked request (epd_models/user_text.py), so the
checks see where each client string landed: a template "renders" assistant `tool_calls` when each call's name
shows up, `tool` turns when their contents show up, and `tools` when the render with them differs from the one
without. What it cannot render is given to it as text in the family's format (epd_models/tool_prompt.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jinja2 import TemplateError

from epd_models.tool_parsers import ToolFormat
from epd_models.tool_prompt import with_system

Apply = Callable[[list[dict[str, Any]], "list[Any] | None"], str]  # (messages, tools) -> rendered prompt
_CANNOT = (TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError)  # a template refusing


def with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls checked, their `arguments` JSON text made a dict (templates expect one; text that is
    not a JSON object stays text). Messages without tool calls are returned as they are."""
    return [_parse_calls(m) if isinstance(m, dict) and m.get("tool_calls") else m for m in messages]


def _parse_calls(msg: dict[str, Any]) -> dict[str, Any]:
    calls = msg["tool_calls"]
    if msg.get("role") != "assistant" or not isinstance(calls, list):
        raise ValueError("tool_calls must be a list, on an assistant message")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError("each tool call needs a function with a non-empty string name")
        out.append({**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}})
    return {**msg, "tool_calls": out}


def _arguments(value: Any) -> Any:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


@dataclass(frozen=True)
class ToolPlan:
    """What the template renders itself; the rest is text in `fmt`'s format."""

    fmt: ToolFormat
    tools_in_template: bool = True
    calls_as_text: bool = False
    results_as_text: bool = False

    def prepare(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> tuple[list[dict[str, Any]],
                                                                                        list[Any] | None]:
        """The messages and tools to hand the template."""
        if self.calls_as_text or self.results_as_text:
            messages = _as_text(messages, self.fmt, self.calls_as_text, self.results_as_text)
        if tools and not self.tools_in_template:
            return with_system(messages, self.fmt.system_prompt(tools)), None
        return messages, tools or None


def choose_plan(apply: Apply, messages: list[dict[str, Any]], tools: list[Any] | None, fmt: ToolFormat) -> ToolPlan:
    """The plan for this request (`messages` and `tools` marked: every client string a unique sentinel)."""
    plan = ToolPlan(fmt)
    if any(_is_call(m) or _is_result(m) for m in messages):
        plan = _history_plan(apply, messages, fmt)
    if tools:
        msgs, _ = plan.prepare(messages, None)
        try:
            native = apply(msgs, tools) != apply(msgs, None)
        except _CANNOT:
            native = False
        plan = replace(plan, tools_in_template=native)
    return plan


def _history_plan(apply: Apply, messages: list[dict[str, Any]], fmt: ToolFormat) -> ToolPlan:
    for calls, results in ((False, False), (False, True), (True, True)):
        plan = ToolPlan(fmt, calls_as_text=calls, results_as_text=results)
        try:
            rendered = apply(plan.prepare(messages, None)[0], None)
        except _CANNOT:
            continue
        names = [c["function"]["name"] for m in messages if not calls and _is_call(m) for c in m["tool_calls"]]
        contents = [s for m in messages if not results and _is_result(m) for s in _strings(m.get("content"))]
        if all(s in rendered for s in names + contents):
            return plan
    return ToolPlan(fmt, calls_as_text=True, results_as_text=True)  # the template's error, if any, comes later


def _is_call(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))


def _is_result(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") == "tool"


def _strings(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content] if content else []
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]]
    return []


def _as_text(messages: list[dict[str, Any]], fmt: ToolFormat, calls: bool, results: bool) -> list[dict[str, Any]]:
    """Assistant calls as assistant text (`calls`); each run of tool turns as one user turn (`results`)."""
    out: list[dict[str, Any]] = []
    pending: list[Any] = []  # contents of the tool turns not yet written
    ends: list[Any] = [*messages, None]
    for m in ends:
        if results and _is_result(m):
            pending.append(m.get("content") or "")
            continue
        if pending:
            out.append({"role": "user", "content": _join(fmt.results_text(pending))})
            pending = []
        if m is None:
            break
        if calls and _is_call(m):
            texts = [fmt.call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = m.get("content")
            pieces = [content, fmt.call_separator] if content else []
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**rest, "content": _join([*pieces, fmt.call_separator.join(texts)])})
        else:
            out.append(m)
    return out


def _join(pieces: list[Any]) -> Any:
    """One content: a string when every piece is one, else a list of parts (image parts kept in order)."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    parts: list[Any] = []
    for p in pieces:
        if isinstance(p, list):
            parts += p
        elif isinstance(p, str) and p:
            parts.append({"type": "text", "text": p})
    return parts
