"""The Hermes/Qwen tool format as text: the system prompt that lists the tools, one call as the model writes it,
and one tool result as the model reads it.

Used where the checkpoint's chat template cannot do it: a template that ignores `tools` gets the system prompt
(epd_models/chat.py), one that cannot render assistant `tool_calls` or `tool` turns gets them as text
(epd_models/tool_history.py). The tiny and demo templates (epd_builders/tokenizer.py) print the same text, so both
ways give one prompt. The words are ours; the markup (<tools>, <tool_call>, <tool_response>) is what Qwen2.5 and
Hermes models were trained on.
"""
from __future__ import annotations

import json
from typing import Any

TOOLS_HEADER = ("# Tools\n\nYou can call functions to help with the request. Each one is described by a JSON "
                "object, one per line, between <tools> and </tools>:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nTo call a function, write a JSON object with its name and its arguments between "
                "<tool_call> and </tool_call>, one block per call:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')
CALL_BEGIN, CALL_END, CALL_SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"
RESULT_BEGIN, RESULT_END, RESULT_SEPARATOR = "<tool_response>\n", "\n</tool_response>", "\n"


def system_prompt(tools: list[Any]) -> str:
    """The tools block, each tool as the templates' `tojson` prints it."""
    return TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER


def call_text(name: Any, arguments: Any) -> str:
    """One call as the model writes it (arguments: a dict, or the client's text when it was not JSON)."""
    return CALL_BEGIN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CALL_END


def with_system(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """`prompt` appended to the first system message (after a blank line), or a new system message first."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list) and content:
            first["content"] = [*content, {"type": "text", "text": "\n\n" + prompt}]
        elif isinstance(content, str) and content:
            first["content"] = content + "\n\n" + prompt
        else:
            first["content"] = prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
