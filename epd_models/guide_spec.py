"""What a constrained sequence's output must be: the spec the decoder compiles into a grammar (decoder_service/grammar.py).

Plain data, torch-free: built from the request's `response_format` (decoder) or from its `tools` and `tool_choice`
by the family's tool format (epd_models/tool_parsers.py). Equal specs compile once (the compiler caches by spec).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class GuideSpec:
    """json_object: any JSON object. json_schema: JSON matching `schema`. tool_calls: between `min_items` and
    `max_items` (None: no limit) calls, each `begin` + JSON matching `schema` + `end`, separated by `separator`."""

    kind: Literal["json_object", "json_schema", "tool_calls"]
    schema: str = ""  # canonical JSON text of the JSON Schema (json_schema, tool_calls): see `canonical`
    strict: bool = False  # json_schema: no properties beyond the schema's (OpenAI's strict)
    begin: str = ""
    end: str = ""
    separator: str = ""
    min_items: int = 1
    max_items: int | None = 1


def canonical(schema: dict[str, Any]) -> str:
    """The schema as compact JSON text, keys in the client's order (the output follows that order): the compiler's cache key."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
