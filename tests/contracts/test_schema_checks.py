"""epd_contracts/schema_checks.py's per-object patternProperties bound, apart from the whole schema's regex total:
one object with 17 patterns (far fewer than the 64 regexes a schema may hold) is refused for that object alone."""
from __future__ import annotations

from typing import Any

from epd_contracts.schema_checks import MAX_PATTERN_PROPERTIES, MAX_SCHEMA_REGEXES, schema_cost_error


def one_object(patterns: int) -> dict[str, Any]:
    return {"type": "object", "patternProperties": {f"^k{i}x$": {"type": "string"} for i in range(patterns)}}


def test_one_object_over_the_per_object_bound_is_refused_below_the_total() -> None:
    over = MAX_PATTERN_PROPERTIES + 1
    assert over == 17 and over < MAX_SCHEMA_REGEXES  # the total cannot be what refuses it
    error = schema_cost_error(one_object(over))
    assert error is not None
    assert f"{over} patternProperties" in error and f"at most {MAX_PATTERN_PROPERTIES}" in error


def test_one_object_over_the_bound_nested_in_a_small_schema_is_refused() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a+$"}, "b": one_object(17)}}
    assert "17 patternProperties" in str(schema_cost_error(schema))


def test_the_bound_itself_and_the_same_patterns_over_two_objects_pass() -> None:
    assert schema_cost_error(one_object(MAX_PATTERN_PROPERTIES)) is None
    split = {"type": "object", "properties": {"a": one_object(9), "b": one_object(8)}}  # 17 in all, apart
    assert schema_cost_error(split) is None
