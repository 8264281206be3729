"""Tool formats: the streaming Hermes/Qwen parser (the same answer however the text is split), the guide specs
for each tool_choice, and the registry."""
from __future__ import annotations

import json
import random
import re

import pytest

from epd_contracts.generate import ToolCallDelta, ToolChoice
from epd_models.guide_spec import canonical
from epd_models.tool_parsers import HERMES, HermesFormat, ToolFormat, register, tool_format
from epd_models.tool_stream import TaggedParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TEXTS = {
    "plain": "The shape is red. <b> a < b <tool",
    "one_call": CALL,
    "content_around": "Let me look.\n" + CALL + "\nDone <tool_",
    "two_calls": CALL + "\n" + CALL.replace("get_weather", "get_time") + "\n",
    "not_json": "ok <tool_call>\n{not json}\n</tool_call> then " + CALL,
    "no_name": '<tool_call>{"arguments": {}}</tool_call>' + CALL,
    "unclosed_call": "x " + CALL[:-len("\n</tool_call>")],
    "unclosed_junk": "x <tool_call>\n{\"name\": \"f\", ",
    "partial_tag_at_end": "the end <tool_cal",
    "string_arguments": '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "deep": "<tool_call>" + "[" * 100_000 + "</tool_call>",
    "unicode": '<tool_call>{"name": "f", "arguments": {"q": "é 😀 <|im_start|>"}}</tool_call>\n\n',
}


def _run(pieces: list[str]) -> tuple[str, list[ToolCallDelta], int]:
    parser = HERMES.parser()
    content, calls = [], []
    for piece in pieces:
        delta = parser.feed(piece)
        content.append(delta.content)
        calls += delta.calls
    delta = parser.flush()
    return "".join(content) + delta.content, [*calls, *delta.calls], parser.num_calls


def _without_ids(calls: list[ToolCallDelta]) -> list[tuple[int, str | None, str]]:
    return [(c.index, c.name, c.arguments) for c in calls]


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", TEXTS)
def test_any_split_gives_the_same_content_and_calls(name: str) -> None:
    text = TEXTS[name]
    whole, calls, num = _run([text])
    splits = [list(text)] + [[text[:k], text[k:]] for k in range(1, min(len(text), 300))]
    rng = random.Random(name)
    splits += [_chunks(text, rng) for _ in range(50)]
    for pieces in splits:
        content, split_calls, split_num = _run(pieces)
        assert (content, _without_ids(split_calls), split_num) == (whole, _without_ids(calls), num), pieces


def test_a_call_becomes_one_delta_with_compact_arguments_and_a_fresh_id() -> None:
    content, calls, num = _run([TEXTS["two_calls"]])
    assert content == "" and num == 2
    assert _without_ids(calls) == [(0, "get_weather", '{"city":"Paris","days":[1,2]}'),
                                   (1, "get_time", '{"city":"Paris","days":[1,2]}')]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id or "") for c in calls)
    assert calls[0].id != calls[1].id


def test_content_around_calls_is_kept_and_whitespace_between_them_dropped() -> None:
    content, calls, _ = _run([TEXTS["content_around"]])
    assert content == "Let me look.\nDone <tool_" and [c.name for c in calls] == ["get_weather"]
    assert _run(["a \n"]) == ("a \n", [], 0), "an answer without calls is given out whole"


def test_content_streams_before_the_call_completes() -> None:
    parser = HERMES.parser()
    assert parser.feed("Sure, <tool").content == "Sure,"
    assert parser.feed("s> are").content == " <tools> are"
    assert parser.feed(" here\n<tool_call>\n{\"name\": \"f\"").content == " here"
    delta = parser.feed(', "arguments": {}}\n</tool_call>')
    assert delta.content == "" and [(c.name, c.arguments) for c in delta.calls] == [("f", "{}")]


@pytest.mark.parametrize("name", ["not_json", "no_name", "unclosed_junk", "deep", "partial_tag_at_end"])
def test_a_malformed_call_is_passed_through_as_content(name: str) -> None:
    content, calls, num = _run([TEXTS[name]])
    assert num == len(calls) == TEXTS[name].count(CALL)
    assert content.replace(" ", "") == TEXTS[name].replace(CALL, "").replace(" ", ""), "every character is kept"


def test_an_unclosed_whole_call_at_the_end_is_a_call() -> None:
    content, calls, _ = _run([TEXTS["unclosed_call"]])
    assert content == "x" and [c.name for c in calls] == ["get_weather"]


def test_arguments_written_as_a_json_string_are_parsed() -> None:
    assert _without_ids(_run([TEXTS["string_arguments"]])[1]) == [(0, "f", '{"a":1}')]


def test_other_tags_can_be_parsed_the_same_way() -> None:
    parser = TaggedParser("[TOOL]", "[/TOOL]")
    delta = parser.feed('hi [TOOL]{"name": "f", "arguments": {"x": 1}}[/TOOL]')
    assert delta.content == "hi" and [(c.name, c.arguments) for c in delta.calls] == [("f", '{"x":1}')]


WEATHER: dict[str, object] = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def _item(name: str, parameters: dict[str, object]) -> dict[str, object]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_any_tool(parallel: bool) -> None:
    spec = HERMES.guide(TOOLS, ToolChoice(mode="required", parallel=parallel))
    assert spec is not None and spec.kind == "tool_calls"
    no_parameters: dict[str, object] = {"type": "object", "properties": {}}
    assert spec.schema == canonical({"anyOf": [_item("get_weather", WEATHER), _item("now", no_parameters)]})
    assert (spec.begin, spec.end, spec.separator, spec.min_items) == ("<tool_call>\n", "\n</tool_call>", "\n", 1)
    assert spec.max_items == (None if parallel else 1)


def test_a_named_function_constrains_to_that_tool() -> None:
    spec = HERMES.guide(TOOLS, ToolChoice(mode="function", name="get_weather", parallel=False))
    assert spec is not None and json.loads(spec.schema) == {"anyOf": [_item("get_weather", WEATHER)]}
    assert spec.max_items == 1


def test_a_named_function_that_is_not_a_tool_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'get_time'"):
        HERMES.guide(TOOLS, ToolChoice(mode="function", name="get_time"))


@pytest.mark.parametrize("tools", [[{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
                                   [{"type": "retrieval", "function": {"name": "f"}}], ["f"],
                                   [{"type": "function", "function": {"name": "f", "parameters": []}}], []])
def test_a_malformed_tool_list_is_refused(tools: list[object]) -> None:
    with pytest.raises(ValueError, match="tool"):
        HERMES.guide(tools, ToolChoice(mode="required"))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_auto_and_none_are_unconstrained(mode: str) -> None:
    assert HERMES.guide(TOOLS, ToolChoice(mode=mode)) is None  # type: ignore[arg-type]


def test_the_registry_defaults_to_hermes_and_takes_other_formats() -> None:
    assert all(tool_format(t) is HERMES for t in ("qwen2_vl", "qwen2_5_vl", "llava", "never_heard_of_it"))

    class Other(HermesFormat):
        pass

    other: ToolFormat = Other()
    register("tiny_other_family", other)
    assert tool_format("tiny_other_family") is other and tool_format("llava") is HERMES
