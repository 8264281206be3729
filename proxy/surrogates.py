"""Lone surrogates: JSON can escape half of a UTF-16 pair (`"\\ud800"`); Python's json parses it into a str that
has no UTF-8 form, so it fails wherever the request is encoded again (a worker call, a log line, a hash).

`SurrogateFree` is the base of every request body model: before any field is validated it walks the parsed body
and refuses the first string (or object key) with a lone surrogate, as a 400 naming its path (`messages.0.content`),
the way the other 400s name their param. A valid pair is one character after parsing, never a surrogate.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, model_validator

from epd_common.errors import bad_request

_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def lone_surrogate_path(body: Any) -> tuple[str, bool] | None:
    """(path, is a key) of the first string or object key in `body` holding a lone surrogate, in document order;
    a key's path is the object's (the key itself cannot be named: it has no UTF-8 form)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(body, ())]
    while stack:  # iterative: nesting is bounded by the JSON parser, not by this walk
        value, path = stack.pop()
        if isinstance(value, str):
            if _lone(value):
                return ".".join(path), False
        elif isinstance(value, dict):
            if any(isinstance(k, str) and _lone(k) for k in value):
                return ".".join(path), True
            stack.extend((v, (*path, str(k))) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in reversed(list(enumerate(value))))
    return None


class SurrogateFree(BaseModel):
    """A request body whose every text is valid Unicode (a 400 naming the first field that is not)."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        found = lone_surrogate_path(data)
        if found is not None:
            path, is_key = found
            what = f"a key of {path or 'the body'}" if is_key else path
            # NOTE: an APIError, not a ValueError: pydantic lets it through, so the 400 names the field's path
            raise bad_request(f"{what}: text with a lone UTF-16 surrogate (\\ud800-\\udfff) is not valid Unicode",
                              param=path or None, code="invalid_request")
        return data
