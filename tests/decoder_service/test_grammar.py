"""Guides from decoder_service.grammar: sampled outputs always parse and validate, errors name the problem."""
from __future__ import annotations

import json
import re
import threading
from functools import cache
from typing import Any

import jsonschema
import pytest
import torch

from decoder_service.grammar import (
    CompiledGuide,
    GuideCompiler,
    GuideError,
    apply_bitmask,
    refused_on_device,
    spec_for,
)
from epd_builders.tokenizer import train_tokenizer
from epd_contracts.generate import ResponseFormat
from epd_models.guide_spec import GuideSpec, canonical

VOCAB = 512  # the LM head is wider than the tokenizer (430 tokens): the rest must never be allowed
MAX_TOKENS = 4000

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}, "name": {"type": "string"}},
     "required": ["age", "name"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "address": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}, "required": ["id", "address"]}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                      "none": {"type": "null"}}, "required": ["color", "ok", "none"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 2,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": ["integer", "null"]},
                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["x", "n", "zip"]},
    {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/point"}]}, "minItems": 1,
     "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": False}}},
]


@cache
def tokenizer() -> Any:
    return train_tokenizer("<image>", "<image>")


@cache
def eos_ids() -> frozenset[int]:
    return frozenset({tokenizer().eos_token_id, tokenizer().convert_tokens_to_ids("<|endoftext|>")})


@cache
def closers() -> torch.Tensor:
    """A bias toward tokens that close strings, arrays and objects, so random outputs end within MAX_TOKENS."""
    bias = torch.zeros(VOCAB)
    for token in range(len(tokenizer())):
        if any(c in tokenizer().decode([token]) for c in '"]},'):
            bias[token] = 4.0
    return bias


def compiler(**kw: Any) -> GuideCompiler:
    return GuideCompiler(tokenizer(), VOCAB, set(eos_ids()), **kw)


def sample(compiled: CompiledGuide, seed: int) -> str:
    """Random logits under the guide's mask until an eos: the output text (the eos not included)."""
    guide, generator = compiled.matcher(), torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = guide.mask(torch.randn(VOCAB, generator=generator) * 2 + closers())
        assert logits.shape == (VOCAB,) and torch.isinf(logits[len(tokenizer()):]).all()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        guide.accept(token)
        if token in eos_ids():
            assert guide.terminated
            return str(tokenizer().decode(tokens))
        tokens.append(token)
    raise AssertionError(f"no eos after {MAX_TOKENS} tokens")


def feed(compiled: CompiledGuide, text: str) -> Any:
    guide = compiled.matcher()
    for token in tokenizer().encode(text, add_special_tokens=False):
        guide.accept(token)
    return guide


def test_json_object_outputs_parse_as_objects() -> None:
    compiled = compiler().compile(GuideSpec(kind="json_object"))
    for seed in range(4):
        assert isinstance(json.loads(sample(compiled, seed)), dict)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_schema_outputs_parse_and_validate(schema: dict[str, Any]) -> None:
    compiled = compiler().compile(GuideSpec(kind="json_schema", schema=canonical(schema)))
    for seed in range(3):
        jsonschema.validate(json.loads(sample(compiled, seed)), schema)


def test_strict_forbids_properties_the_schema_does_not_name() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    free = compiler().compile(GuideSpec(kind="json_schema", schema=canonical(schema)))
    strict = compiler().compile(GuideSpec(kind="json_schema", schema=canonical(schema), strict=True))
    feed(free, '{"a": 1, "b": 2}')
    with pytest.raises(GuideError) as err:
        feed(strict, '{"a": 1, "b": 2}')
    assert err.value.param == "response_format"


def test_a_complete_output_allows_only_eos() -> None:
    compiled = compiler().compile(GuideSpec(kind="json_schema", schema=canonical(SCHEMAS[0])))
    guide = feed(compiled, '{"age": 36, "name": "Ada"}')
    allowed = torch.isfinite(guide.mask(torch.zeros(VOCAB))).nonzero().flatten().tolist()
    assert set(allowed) == eos_ids() and guide.terminated
    guide.accept(min(eos_ids()))


def test_properties_come_in_the_order_of_the_spec_text() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
              "required": ["b", "a"]}
    compiled = compiler().compile(GuideSpec(kind="json_schema", schema=json.dumps(schema)))
    for seed in range(3):
        assert list(json.loads(sample(compiled, seed)))[:2] == ["b", "a"]


def test_a_refused_token_is_a_guide_error() -> None:
    guide = compiler().compile(GuideSpec(kind="json_object")).matcher()
    refused = int(torch.isinf(guide.mask(torch.zeros(VOCAB))).nonzero()[0])
    with pytest.raises(GuideError, match="broke the response_format grammar"):
        guide.accept(refused)


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 3), (0, None), (2, None)])
def test_tool_calls_are_begin_json_end_repeated(low: int, high: int | None) -> None:
    schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False}
    spec = GuideSpec(kind="tool_calls", schema=canonical(schema), begin="<tool_call>\n", end="\n</tool_call>",
                     separator="\n", min_items=low, max_items=high)
    compiled = compiler().compile(spec)
    for seed in range(3):
        text = sample(compiled, seed)
        calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)
        assert "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) == text
        assert low <= len(calls) <= (high if high is not None else len(calls))
        for call in calls:
            jsonschema.validate(json.loads(call), schema)


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "nonsense"}, "nonsense"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(?=x)"}, "look-around"),
])
def test_an_uncompilable_schema_is_a_guide_error_naming_the_problem(schema: dict[str, Any], problem: str) -> None:
    with pytest.raises(GuideError, match=problem) as err:
        compiler().compile(GuideSpec(kind="json_schema", schema=canonical(schema)))
    assert err.value.param == "response_format"
    with pytest.raises(GuideError) as err:
        compiler().compile(GuideSpec(kind="tool_calls", schema=canonical(schema), begin="<a>", end="</a>"))
    assert err.value.param == "tools"


def test_a_schema_that_is_not_an_object_is_a_guide_error() -> None:
    with pytest.raises(GuideError, match="must be a JSON object"):
        compiler().compile(GuideSpec(kind="json_schema", schema="[1]"))


def test_equal_specs_hit_the_cache_and_it_stays_bounded() -> None:
    comp = compiler(cache_size=2)
    first = comp.compile(GuideSpec(kind="json_schema", schema=canonical(SCHEMAS[0])))
    assert comp.compile(GuideSpec(kind="json_schema", schema=canonical(SCHEMAS[0]))) is first
    comp.compile(GuideSpec(kind="json_object"))
    comp.compile(GuideSpec(kind="json_schema", schema=canonical(SCHEMAS[1])))
    assert comp.compile(GuideSpec(kind="json_schema", schema=canonical(SCHEMAS[0]))) is not first


def test_the_cache_is_bounded_by_schema_bytes_too() -> None:
    """Distinct large schemas (a compiled grammar is ~75x its schema) cannot fill the cache past its byte budget."""
    specs = [GuideSpec(kind="json_schema", schema=canonical({"type": "object", "properties": {
        f"k{i}_{j}": {"type": "string"} for j in range(40)}})) for i in range(6)]
    budget = 2 * len(specs[0].schema) + 10
    comp = compiler(cache_schema_bytes=budget)
    for spec in specs:
        comp.compile(spec)
        assert comp.cached_schema_bytes <= budget
    assert comp.compile(specs[-1]) is comp.compile(specs[-1])  # the most recent stays cached
    huge = GuideSpec(kind="json_schema", schema=canonical({"type": "object", "properties": {
        f"h{j}": {"type": "string"} for j in range(200)}}))
    assert comp.compile(huge) is not comp.compile(huge)  # over the whole budget: compiled, never kept
    assert comp.cached_schema_bytes <= budget


def test_two_threads_compiling_one_spec_get_the_same_guide() -> None:
    comp, barrier, results = compiler(), threading.Barrier(2), []
    spec = GuideSpec(kind="json_schema", schema=canonical(SCHEMAS[1]))

    def work() -> None:
        barrier.wait()
        results.append(comp.compile(spec))
    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and results[0] is results[1]
    jsonschema.validate(json.loads(sample(results[0], 0)), SCHEMAS[1])


def test_spec_for_maps_each_response_format() -> None:
    schema = {"type": "object"}
    assert spec_for(ResponseFormat(type="text")) is None
    assert spec_for(ResponseFormat(type="json_object")) == GuideSpec(kind="json_object")
    assert spec_for(ResponseFormat(type="json_schema", json_schema=schema, strict=True)) == GuideSpec(
        kind="json_schema", schema=canonical(schema), strict=True)
    with pytest.raises(GuideError):
        spec_for(ResponseFormat(type="json_schema"))


def test_both_bitmask_unpackings_refuse_exactly_the_zero_bits() -> None:
    words = torch.tensor([0, -1, -(1 << 31), 0b1011], dtype=torch.int32)  # none, all, bit 31 only, bits 0 1 3
    vocab = 4 * 32 - 3
    expected = [not (int(words[i // 32]) >> (i % 32)) & 1 for i in range(vocab)]
    assert refused_on_device(words, vocab).tolist() == expected
    assert torch.isinf(apply_bitmask(torch.zeros(vocab), words)).tolist() == expected
