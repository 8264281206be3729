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
from epd_models.tool_stream import ParsedDelta, TaggedParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
CALL_ARGS = '{"city": "Paris", "days": [1, 2]}'
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
    "spaced_head": '<tool_call>\n{ "name" :"f",\n  "arguments"\t:  {"a": {"b": "}"}, "c": [ ]}  \n}\n</tool_call>',
    "braces_in_arguments": '<tool_call>{"name": "f", "arguments": {"s": "} </tool_ <", "o": {"p": {}}}}</tool_call>',
    "escaped_name": '<tool_call>{"name": "f\\"g", "arguments": {}}</tool_call>',
    "arguments_first": '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
    "extra_key": '<tool_call>{"name": "f", "id": 7, "arguments": {"a":  1}}</tool_call>',
    "malformed_streamed": 'a <tool_call>{"name": "f", "arguments": {"a": 1}, "x": 2}</tool_call>b',
    "no_wrapper_brace": '<tool_call>{"name": "f", "arguments": {"a": 1}\n</tool_call>',
    "broken_arguments": '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
    "unclosed_streamed": '<tool_call>{"name": "f", "arguments": {"a": [1, 2',
    "empty_name": '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    "cut_in_end_tag": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c',
    "cut_in_end_tag_malformed": '<tool_call>{"name": "f", "arguments": {"a": 1\n</tool_c',
}
# (content, [(name, joined arguments)]) of each text that makes calls or streams one
EXPECTED = {
    "one_call": ("", [("get_weather", CALL_ARGS)]),
    "content_around": ("Let me look.\nDone <tool_", [("get_weather", CALL_ARGS)]),
    "two_calls": ("", [("get_weather", CALL_ARGS), ("get_time", CALL_ARGS)]),
    "unclosed_call": ("x", [("get_weather", CALL_ARGS)]),
    "string_arguments": ("", [("f", '{"a": 1}')]),
    "unicode": ("", [("f", '{"q": "é 😀 <|im_start|>"}')]),
    "spaced_head": ("", [("f", '{"a": {"b": "}"}, "c": [ ]}')]),
    "braces_in_arguments": ("", [("f", '{"s": "} </tool_ <", "o": {"p": {}}}')]),
    "escaped_name": ("", [('f"g', "{}")]),
    "arguments_first": ("", [("f", '{"a": 1}')]),
    "extra_key": ("", [("f", '{"a":  1}')]),
    # a streamed call that is malformed at its end stays a call: its arguments are the rest of its text
    "malformed_streamed": ("ab", [("f", '{"a": 1}, "x": 2}')]),
    "no_wrapper_brace": ("", [("f", '{"a": 1}')]),
    "broken_arguments": ("", [("f", '{"a": }}')]),
    "unclosed_streamed": ("", [("f", '{"a": [1, 2')]),
    # cut off inside its end tag (max_tokens): the partial tag is dropped when the call before it is whole
    "cut_in_end_tag": ("", [("f", '{"a": 1}')]),
    "cut_in_end_tag_malformed": ("", [("f", '{"a": 1\n</tool_c')]),
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


def _joined(calls: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """Each call's name and joined arguments, checking the deltas are as OpenAI streams them: a call's first
    delta has its index (the next one), a fresh id and the name; its next ones the same index and more arguments."""
    out: list[tuple[str, str]] = []
    for c in calls:
        if c.index == len(out):
            assert re.fullmatch(r"call_[0-9a-f]{24}", c.id or "") and c.name, c
            out.append((c.name, c.arguments))
        else:
            assert c.index == len(out) - 1 and c.id is None and c.name is None and c.arguments, c
            out[-1] = (out[-1][0], out[-1][1] + c.arguments)
    return out


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", TEXTS)
def test_any_split_gives_the_same_content_and_calls(name: str) -> None:
    text = TEXTS[name]
    whole, calls, num = _run([text])
    assert num == len(_joined(calls))
    splits = [list(text)] + [[text[:k], text[k:]] for k in range(1, min(len(text), 300))]
    rng = random.Random(name)
    splits += [_chunks(text, rng) for _ in range(50)]
    for pieces in splits:
        content, split_calls, split_num = _run(pieces)
        assert (content, _joined(split_calls), split_num) == (whole, _joined(calls), num), pieces


@pytest.mark.parametrize("name", EXPECTED)
def test_calls_have_the_arguments_as_the_model_wrote_them(name: str) -> None:
    content, calls, _ = _run([TEXTS[name]])
    assert (content, _joined(calls)) == EXPECTED[name]
    for _, arguments in EXPECTED[name][1]:
        if name not in ("malformed_streamed", "broken_arguments", "unclosed_streamed", "cut_in_end_tag_malformed"):
            assert isinstance(json.loads(arguments), dict)


def test_each_call_has_a_fresh_id() -> None:
    ids = [c.id for c in _run([TEXTS["two_calls"] * 2])[1] if c.id]
    assert len(ids) == len(set(ids)) == 4


def test_char_by_char_a_call_streams_its_head_then_its_arguments() -> None:
    text = TEXTS["content_around"]
    parser, got = HERMES.parser(), []
    for i, char in enumerate(text):
        got += [(i, c) for c in parser.feed(char).calls]
    got += [(len(text), c) for c in parser.flush().calls]
    head_at = text.index('"arguments": {') + len('"arguments": ')  # the `{` opening the arguments
    end_at = text.index("</tool_call>")
    assert got[0][0] == head_at and (got[0][1].name, got[0][1].arguments) == ("get_weather", "")
    pieces = [(i, c.arguments) for i, c in got[1:]]
    assert len(pieces) > 10 and all(i < end_at for i, _ in pieces), "the arguments stream before the end tag"
    assert "".join(a for _, a in pieces) == CALL_ARGS and json.loads(CALL_ARGS) == {"city": "Paris", "days": [1, 2]}


def test_the_wrapper_brace_is_held_back_until_the_call_ends() -> None:
    parser = HERMES.parser()
    delta = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}')
    assert [(c.name, c.arguments) for c in delta.calls] == [("f", ""), (None, '{"a": {"b": 1}}')]
    assert parser.feed(" \n</tool_").calls == [] and parser.feed("call>\n").calls == []
    assert parser.flush() == ParsedDelta() and parser.num_calls == 1


def test_a_held_brace_that_is_not_the_end_is_given_out() -> None:
    parser = HERMES.parser()
    pieces = [[c.arguments for c in parser.feed(text).calls]
              for text in ['<tool_call>{"name": "f", "arguments": {"a": {"b": 1}', ', "c": 2', "}", "\n}", "</tool_call>"]]
    assert pieces == [["", '{"a": {"b": 1'], ['}, "c": 2'], [], ["}"], []]


def test_a_call_without_a_head_waits_for_its_end_and_is_one_delta() -> None:
    parser = HERMES.parser()
    text = TEXTS["arguments_first"]
    assert all(parser.feed(char) == ParsedDelta() for char in text[:-1])
    (call,) = parser.feed(text[-1]).calls
    assert (call.index, call.name, call.arguments) == (0, "f", '{"a": 1}') and call.id


def test_a_streamed_call_that_turns_out_malformed_stays_a_call() -> None:
    parser = HERMES.parser()
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}, "x"').calls
    assert [(c.name, c.arguments) for c in first] == [("f", ""), (None, '{"a": 1}, "x"')]
    rest = parser.feed(": 2}</tool_call> ok")
    assert rest.content == " ok" and [(c.index, c.arguments) for c in rest.calls] == [(0, ": 2}")]


def test_content_around_calls_is_kept_and_whitespace_between_them_dropped() -> None:
    content, calls, _ = _run([TEXTS["content_around"]])
    assert content == "Let me look.\nDone <tool_" and [c.name for c in calls if c.name] == ["get_weather"]
    assert _run(["a \n"]) == ("a \n", [], 0), "an answer without calls is given out whole"


def test_content_streams_before_the_call_completes() -> None:
    parser = HERMES.parser()
    assert parser.feed("Sure, <tool").content == "Sure,"
    assert parser.feed("s> are").content == " <tools> are"
    assert parser.feed(" here\n<tool_call>\n{\"name\": \"f\"").content == " here"
    delta = parser.feed(', "arguments": {}}\n</tool_call>')
    assert delta.content == "" and _joined(delta.calls) == [("f", "{}")]


@pytest.mark.parametrize("name", ["not_json", "no_name", "unclosed_junk", "deep", "partial_tag_at_end", "empty_name"])
def test_a_malformed_call_is_passed_through_as_content(name: str) -> None:
    content, calls, num = _run([TEXTS[name]])
    assert num == len(_joined(calls)) == TEXTS[name].count(CALL)
    assert content.replace(" ", "") == TEXTS[name].replace(CALL, "").replace(" ", ""), "every character is kept"


def test_other_tags_can_be_parsed_the_same_way() -> None:
    parser = TaggedParser("[TOOL]", "[/TOOL]")
    delta = parser.feed('hi [TOOL]{"name": "f", "arguments": {"x": 1}}[/TOOL]')
    assert delta.content == "hi" and _joined(delta.calls) == [("f", '{"x": 1}')]


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
