"""Decoding a contract from bytes or Python objects, with every failure named by the field it is about.

msgspec reports where a value failed as a path (`... - at `$.sampling.stop[1]``); `ContractError.param` is that
path in the dotted form the OpenAI error's `param` uses (`sampling.stop.1`). A check that runs in a Struct's
`__post_init__` raises FieldError to name its field (msgspec keeps it as the ValidationError's cause).
"""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
_AT = re.compile(r" - at (?:`key` in )?`\$(.*)`$")  # a dict's bad key is reported at the dict
_STEP = re.compile(r'\.([^.\[]+)|\[(\d+)\]|\["((?:[^"\\]|\\.)*)"\]')
_FIELD = re.compile(r"(?:unknown|missing required) field `(.*)`")  # named in the message, not the path


class FieldError(ValueError):
    """A `__post_init__` check that failed on one field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ContractError(ValueError):
    """A message that does not satisfy its contract: what is wrong, and the parameter it is about (or None)."""

    def __init__(self, detail: str, param: str | None):
        super().__init__(f"{param}: {detail}" if param else detail)
        self.message, self.detail, self.param = str(self), detail, param


def decode_json(data: bytes, type_: type[T]) -> T:
    """`data` as a `type_`; ContractError if it is not JSON or breaks the contract."""
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise _named(exc) from None
    except msgspec.DecodeError:
        pass
    except RecursionError:  # msgspec recurses per nesting level: a body of 100,000 '[' must be a 400, not a 500
        raise ContractError("request body is nested too deeply", None) from None
    try:  # NaN and Infinity are no JSON, but Python's json reads them: name the field they were sent for
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise ContractError("request body is not valid JSON", None) from None
    convert(obj, type_)
    raise ContractError("request body is not valid JSON", None)


def convert(obj: Any, type_: type[T], strict: bool = True) -> T:
    """`obj` (built-in Python values) as a `type_`; ContractError if it breaks the contract. Not `strict`:
    strings and integral floats that spell a value of the field's type are taken as that value."""
    try:
        return msgspec.convert(obj, type_, strict=strict)
    except msgspec.ValidationError as exc:
        raise _named(exc) from None


def _named(exc: msgspec.ValidationError) -> ContractError:
    text = str(exc)
    at = _AT.search(text)
    path = at.group(1).replace("[...]", "") if at else ""  # `[...]`: a value of a dict, named by the dict
    steps = [next(s for s in m.groups() if s is not None) for m in _STEP.finditer(path)]
    message = text[:at.start()] if at else text
    if (named := _FIELD.search(message)) is not None:
        steps.append(named.group(1))
    elif isinstance(exc.__cause__, FieldError):
        steps.append(exc.__cause__.field)
    return ContractError(message, ".".join(steps) or None)
