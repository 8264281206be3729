"""What a schema is refused for before (or while) its grammar is compiled, and the dead ends left for decoding:
each a GuideError with the param to name and a 400's code, never a long compile or a 502."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest
import torch

from decoder_service.grammar import GuideCompiler, GuideError
from epd_contracts.schema_checks import (
    MAX_PATTERN_PROPERTIES,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_REGEXES,
    schema_cost_error,
    unsatisfiable,
)
from epd_models.guide_spec import GuideSpec, canonical
from tests.decoder_service.test_grammar import VOCAB, compiler, sample, tokenizer

HOSTILE = {"type": "object", "patternProperties": {f"^tag{i}(a|b)*c$": {"type": "string"} for i in range(300)}}
SELF_REQUIRED = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                      "required": ["x"]}}}
ENDLESS_ARRAY = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
TOO_COSTLY = [
    HOSTILE,
    {"type": "object", "properties": {f"p{j}": {"type": "object", "patternProperties": {
        f"^t{j}_{i}x$": {} for i in range(MAX_PATTERN_PROPERTIES)}} for j in range(5)}},  # 80 regexes in all
    {"type": "string", "pattern": "a" * (MAX_REGEX_CHARS + 1)},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^x{i}$"}
                                      for i in range(MAX_SCHEMA_REGEXES + 1)}},
]


def spec(schema: dict[str, Any], kind: str = "json_schema") -> GuideSpec:
    if kind == "tool_calls":
        return GuideSpec(kind="tool_calls", schema=canonical(schema), begin="<a>", end="</a>")
    return GuideSpec(kind="json_schema", schema=canonical(schema))


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema", TOO_COSTLY, ids=["300-pattern-properties", "80-regexes-in-objects",
                                                    "long-regex", "65-patterns"])
@pytest.mark.parametrize(("kind", "param"), [("json_schema", "response_format"), ("tool_calls", "tools")])
def test_a_schema_past_the_cost_bounds_is_refused_before_compiling(schema: dict[str, Any], kind: str,
                                                                  param: str) -> None:
    """The 300-key schema compiled for seconds (6.3 s measured on the demo model); it is refused at once."""
    with pytest.raises(GuideError) as err:
        compiler().compile(spec(schema, kind))
    assert (err.value.param, err.value.code) == (param, "schema_too_complex")


def test_the_cost_bounds_admit_what_they_allow() -> None:
    """The most each bound allows still compiles, and its outputs validate."""
    schema = {"type": "object", "patternProperties": {f"^t{i}(a|b)*c$": {"type": "integer"}
                                                      for i in range(MAX_PATTERN_PROPERTIES)},
              "additionalProperties": False, "properties": {"s": {"type": "string", "pattern": "^[a-z]{0,8}$"}}}
    assert schema_cost_error(schema) is None
    compiled = compiler().compile(spec(schema))
    for seed in range(2):
        jsonschema.validate(json.loads(sample(compiled, seed)), schema)


def test_a_schema_nested_past_the_depth_bound_is_refused_without_recursion() -> None:
    assert schema_cost_error(nested(MAX_SCHEMA_DEPTH - 2)) is None
    assert "deeper than" in str(schema_cost_error(nested(5000)))  # no RecursionError: the walk is iterative
    with pytest.raises(GuideError) as err:
        compiler().compile(spec(nested(MAX_SCHEMA_DEPTH + 1)))
    assert err.value.code == "schema_too_complex"


def test_the_librarys_own_limits_are_a_guide_error_naming_the_param() -> None:
    comp = GuideCompiler(tokenizer(), VOCAB, {tokenizer().eos_token_id},
                         limits=llguidance.LLParserLimits(max_grammar_size=50))
    with pytest.raises(GuideError, match="too big") as err:
        comp.compile(spec({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20)}}))
    assert (err.value.param, err.value.code) == ("response_format", "schema_too_complex")


@pytest.mark.parametrize("schema", [SELF_REQUIRED, ENDLESS_ARRAY,
                                    {"type": "object", "properties": {"a": {"allOf": [{"$ref": "#"}]}},
                                     "required": ["a"]}], ids=["required-self-ref", "min-items-self", "allof"])
def test_a_schema_no_finite_output_matches_is_refused_at_compile_time(schema: dict[str, Any]) -> None:
    """It compiled, then failed mid-stream with 502 generation_failed; now a 400 before any token."""
    assert unsatisfiable(schema) is not None
    with pytest.raises(GuideError, match="no finite JSON document") as err:
        compiler().compile(spec(schema))
    assert (err.value.param, err.value.code) == ("response_format", "unsatisfiable_schema")


@pytest.mark.parametrize("schema", [
    {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}}, "required": ["x"]},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},
    {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}, "v": {"type": "integer"}},
                     "required": ["v"]}}, "$ref": "#/$defs/n"},
], ids=["nullable", "any-of-a-way-out", "optional", "empty-array", "linked-list"])
def test_a_recursive_schema_with_a_way_out_compiles_and_ends(schema: dict[str, Any]) -> None:
    assert unsatisfiable(schema) is None
    compiled = compiler().compile(spec(schema))
    jsonschema.validate(json.loads(sample(compiled, 0)), schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"<|endoftext|>": {"const": "<|endoftext|><|im_end|>"}},
     "required": ["<|endoftext|>"]},
    {"type": "object", "properties": {"a": {"enum": ["ok", "x<|im_end|>"]}}},
    {"const": {"k": ["<image>"]}},
], ids=["name-and-const", "enum", "nested-const"])
def test_a_literal_holding_a_special_token_is_refused_at_compile_time(schema: dict[str, Any]) -> None:
    """The library forces such a literal as the special token, then refuses that token: a dead end mid-stream."""
    with pytest.raises(GuideError, match="special token") as err:
        compiler().compile(spec(schema))
    assert (err.value.param, err.value.code) == ("response_format", "unsatisfiable_schema")


def test_a_dead_end_while_decoding_is_a_guide_error_naming_the_schema() -> None:
    """A pattern that spells a special token passes every check, then dead-ends at the special token."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^<\\|im_end\\|>$"}},
              "required": ["a"]}
    guide = compiler().compile(spec(schema)).matcher()
    with pytest.raises(GuideError) as err:
        for _ in range(40):
            guide.accept(int(torch.argmax(guide.mask(torch.zeros(VOCAB)))))
    assert (err.value.param, err.value.code) == ("response_format", "unsatisfiable_schema")
