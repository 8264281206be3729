"""A checkpoint's chat template, and chat messages -> token ids (one placeholder per image)."""
from __future__ import annotations

import bisect
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd_models.tokenizer_facts import TokenizerFacts, tokenizer_facts
from epd_models.tool_history import choose_plan, with_parsed_arguments
from epd_models.tool_parsers import HERMES, ToolFormat, function_of
from epd_models.user_text import count_added, defang, mark, overlaps, tokenize_isolated

if TYPE_CHECKING:
    from epd_models.halves import LanguageHalf


def chat_template(tokenizer: Any, model_dir: str | Path) -> str:
    """The tokenizer's template, else the processor's (LLaVA checkpoints keep it there)."""
    if tokenizer.chat_template:
        return str(tokenizer.chat_template)
    for name in ("chat_template.jinja", "chat_template.json"):
        path = Path(model_dir) / name
        if path.exists():
            text = path.read_text()
            return str(json.loads(text)["chat_template"]) if name.endswith(".json") else text
    raise ValueError(f"model at {model_dir} has no chat template")


@dataclass(frozen=True)
class ImageEdges:
    """Plain text a family's processor writes around each image (Gemma 3: "\\n\\n" both sides of its span).

    It must be in the prompt's text before tokenizing: tokenized apart from its neighbours, a newline-merging
    tokenizer would cut "user\\n" + "\\n\\n" into other tokens than the processor's "user\\n\\n\\n"."""

    placeholder: str  # what the chat template writes once per image
    before: str
    after: str

    def wrap(self, text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
        """`text` with the edges around each placeholder the template wrote (never one inside a user span in
        `spans`), and the spans where they now are."""
        points: list[tuple[int, str]] = []  # (index in text, what is inserted there), in order
        for m in re.finditer(re.escape(self.placeholder), text):
            if not overlaps(m.span(), spans):
                points += [(m.start(), self.before), (m.end(), self.after)]
        pieces, pos, shifts, total = [], 0, [], 0
        for i, edge in points:
            pieces += [text[pos:i], edge]
            pos, total = i, total + len(edge)
            shifts.append(total)
        pieces.append(text[pos:])
        where = [i for i, _ in points]

        def moved(a: int) -> int:
            k = bisect.bisect_right(where, a)
            return a + (shifts[k - 1] if k else 0)

        return "".join(pieces), [(moved(a), moved(a) + b - a) for a, b in spans]


def image_edges(lm: LanguageHalf) -> ImageEdges | None:
    """The edges render() must write around `lm`'s image placeholders (its family's FamilySpec.text_edges)."""
    before, after = lm.adapter.spec.text_edges
    if not before and not after:
        return None
    return ImageEdges(str(lm.tokenizer.convert_ids_to_tokens(lm.placeholder_id)), before, after)


# NOTE: a fast tokenizer keeps `split_special_tokens` as state on its shared Rust object, set by every call:
# encodes from two threads at once (the decoder prepares requests on a pool) could tokenize a benign prompt with
# a hostile prompt's setting. Every encode of a prompt happens under this lock (tests/models/test_chat_threads.py).
_ENCODING = threading.Lock()


class PromptTooLong(Exception):
    """The prompt cannot fit `max_tokens`; raised before it is tokenized in full. Not a ValueError on purpose:
    callers answer it with context_length_exceeded, not with "cannot build the prompt"."""

    def __init__(self, num_tokens_at_least: int, max_tokens: int) -> None:
        self.num_tokens_at_least, self.max_tokens = num_tokens_at_least, max_tokens
        super().__init__(f"the prompt has at least {num_tokens_at_least} tokens; at most {max_tokens} fit")


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str, max_tokens: int | None = None,
           tools: list[dict[str, Any]] | None = None, tool_format: ToolFormat | None = None,
           image_edges: ImageEdges | None = None) -> list[int]:
    """Apply the chat template (one placeholder per image) and tokenize; user text never becomes an added token.

    Text from the request (contents, text parts, names, tools, tool calls and results) tokenizes exactly as the
    whole prompt did before, unless it contains (or forms, with its neighbours) an added token's string: then that
    string becomes ordinary tokens. The template's own special tokens and image markers are kept.
    See epd_models/user_text.py.

    `tools` (OpenAI's function tools) are rendered by the template; one that ignores them gets `tool_format`'s
    (default: Hermes/Qwen) tools block in the system message, and assistant `tool_calls` or `tool` turns it cannot
    render are given to it as that format's text (epd_models/tool_history.py). Without tools or tool turns the
    prompt is what it was before tools existed.

    `image_edges` (from `image_edges(lm)`): plain text written around each of the template's image placeholders,
    as the family's processor does (Gemma 3), so that it tokenizes with its neighbours exactly as there.

    With `max_tokens`, a prompt that cannot fit raises PromptTooLong before it is tokenized: the rendered text is
    refused when longer than max_tokens x the most characters one token can cover (epd_models/tokenizer_facts.py).
    Worst case: a refusal costs the render (a few copies of the text, O(n) time); a prompt that passes that bound
    is at most max_tokens x max_chars_per_token characters (demo and tiny models: 4096 x 33 = 135k), which is the
    largest prompt that can fit, so a too-long prompt never costs more than serving the longest one that fits.
    """
    try:
        return _render(tokenizer, messages, template, max_tokens, tools, tool_format or HERMES, image_edges)
    except RecursionError as exc:  # tool arguments or schemas nested past what walking them allows
        raise ValueError("the messages or tools are nested too deeply to render") from exc


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str, max_tokens: int | None,
            tools: list[dict[str, Any]] | None, tool_format: ToolFormat, edges: ImageEdges | None) -> list[int]:
    facts = tokenizer_facts(tokenizer)
    for tool in tools or ():
        function_of(tool)  # a malformed tool is refused here, not rendered
    messages = with_parsed_arguments(messages)
    marked = mark(messages, facts, tools)

    def apply(msgs: list[dict[str, Any]], tls: list[Any] | None) -> str:
        return _apply(tokenizer, msgs, template, tls)

    plan = choose_plan(apply, marked.messages, marked.tools, tool_format)

    def draw(msgs: list[dict[str, Any]], tls: list[Any] | None) -> str:
        return apply(*plan.prepare(msgs, tls))

    sentinel_render = draw(marked.messages, marked.tools)
    text, spans = marked.fill(sentinel_render)
    if max_tokens is not None:
        at_least = facts.min_tokens(text)
        if at_least > max_tokens:
            raise PromptTooLong(at_least, max_tokens)
    known: list[tuple[int, int]] | None = None
    if getattr(tokenizer, "is_fast", False):  # offsets are needed to find the spans' tokens
        real = draw(messages, tools)
        known = spans if real == text else marked.align(sentinel_render, real)  # tojson escapes tool text
        text = real if known is not None else text
    with _ENCODING:
        if known is not None:
            if edges is not None:
                text, known = edges.wrap(text, known)
            ids = tokenize_isolated(tokenizer, text, known, facts)
        else:  # the template changes user text (e.g. trims it) or no offsets: spans are unknown
            own = count_added(tokenizer(sentinel_render, add_special_tokens=False)["input_ids"], facts)
            defanged = draw(defang(messages, facts), defang(tools, facts))  # holds only the template's placeholders
            defanged = edges.wrap(defanged, [])[0] if edges is not None else defanged
            ids = _tokenize_defanged(tokenizer, defanged, own, facts)
    if max_tokens is not None and len(ids) > max_tokens:
        raise PromptTooLong(len(ids), max_tokens)
    return ids


def _apply(tokenizer: Any, messages: list[dict[str, Any]], template: str, tools: list[Any] | None = None) -> str:
    # NOTE: like apply_chat_template(tokenize=True), the template owns BOS and other specials
    return str(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, tools=tools))


def _tokenize_defanged(tokenizer: Any, rendered: str, own: int, facts: TokenizerFacts) -> list[int]:
    """`rendered` is the prompt with every reserved string in user text broken up; it must hold exactly the `own`
    added tokens the template makes by itself (counted on the sentinel render), else the request is refused."""
    ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if count_added(ids, facts) != own:
        raise ValueError("the text contains a reserved token sequence that this chat template cannot keep apart")
    return ids
