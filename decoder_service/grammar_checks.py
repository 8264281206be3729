"""What a schema is refused for before its grammar is compiled: a GuideError (a 400 naming the param).

The cost bounds and the unsatisfiable schemas of epd_contracts/schema_checks.py (the proxy refuses them first;
held again here, since a caller may reach /generate directly), and literal text this model cannot write: a
property name, `required` name, `const` or `enum` string that holds a special token's text. The library forces
such a literal with the tokenizer's own split, which picks the special token, and then its grammar refuses that
token (measured: `{"<|endoftext|>": {"const": "<|im_end|>"}}` on the demo model); the output could never end.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from decoder_service.engine.interfaces import RequestFault
from epd_contracts.schema_checks import schema_cost_error, subschemas, unsatisfiable


class GuideError(RequestFault):
    """A spec the library cannot compile, or a token its grammar refuses; `param` is the request field to name,
    `code` the error code of its 400 (a request's own fault: on the engine thread it ends that request alone)."""


def check_schema(schema: dict[str, Any], param: str, specials: re.Pattern[str] | None) -> None:
    """Raise GuideError if compiling `schema` would cost past the bounds, or its output could never end."""
    if (why := schema_cost_error(schema)) is not None:
        raise GuideError(f"{param}: {why}", param, "schema_too_complex")
    if (why := unsatisfiable(schema)) is not None:
        raise GuideError(f"{param}: {why}", param, "unsatisfiable_schema")
    if (found := special_literal(schema, specials)) is not None:
        raise GuideError(f"{param}: the literal {found[0][:100]!r} holds the special token {found[1]!r}, which this "
                         "model cannot write as text", param, "unsatisfiable_schema")


def special_texts(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex finding the text of any special token (as the library marks them: the tokenizer's special and
    added-special tokens); None if it has none. One regex: some tokenizers have thousands (Gemma's unused)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    texts = {t for t in {*tokenizer.all_special_tokens, *(a.content for a in added if a.special)} if t}
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))) if texts else None


def special_literal(schema: Any, specials: re.Pattern[str] | None) -> tuple[str, str] | None:
    """(literal, special token text) for the first literal of the schema that holds a special token's text."""
    if specials is None:
        return None
    for literal in _literals(schema):
        if (found := specials.search(literal)) is not None:
            return literal, found.group()
    return None


def _literals(schema: Any) -> Iterator[str]:
    """Strings the output must spell exactly: property names, required names, const and enum values."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(props := node.get("properties"), dict):
            yield from props
        if isinstance(required := node.get("required"), list):
            yield from (r for r in required if isinstance(r, str))
        yield from _strings([node[k] for k in ("const", "enum") if k in node])
        stack.extend(subschemas(node))


def _strings(data: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (iterative: the value's depth is bounded, not Python's)."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            yield from (k for k in value if isinstance(k, str))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
