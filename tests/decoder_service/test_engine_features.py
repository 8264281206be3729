"""The request surface the engine runs: stop_token_ids, echo, logprobs on deltas, cached tokens, tools, guides."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from decoder_service.generate import generate
from decoder_service.grammar import GuideError
from decoder_service.request import Work
from decoder_service.shell import Engine
from decoder_service.video_gather import Gathered
from epd_common.errors import APIError
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import GenerateRequest, ImageRef, ResponseFormat, ToolChoice
from epd_contracts.sampling import SamplingParams
from tests.decoder_service.engine_run import make_engine, text_prompt
from tests.decoder_service.test_choices import Choices, collect_all

USER = [{"role": "user", "content": "What color is the shape?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                           "required": ["city"], "additionalProperties": False}}}


@pytest.fixture
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dirs["llava"], max_model_len=1024)  # room for the tools' system prompt
    yield eng
    eng.close()


def run_work(engine: Engine, work: Work) -> tuple[Choices, list[Any]]:
    """(texts and dones by choice, every event) of one prepared request."""
    events: list[Any] = []

    async def recording() -> tuple[Choices, list[Any]]:
        job = engine.submit(work)
        put = job.events.put_nowait

        def keep(event: Any) -> None:
            events.append(event)
            put(event)

        job.events.put_nowait = keep  # type: ignore[method-assign,assignment]
        return await collect_all(job), events

    return asyncio.run(recording())


def request(engine: Engine, **kw: Any) -> tuple[Choices, list[Any]]:
    sampling = kw.pop("sampling", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    body = {"messages": USER, **kw} if "prompt" not in kw else kw
    return run_work(engine, engine.prepare(GenerateRequest(sampling=sampling, **body)))


def test_a_stop_token_id_ends_the_choice_unemitted(engine: Engine) -> None:
    prompt = text_prompt(engine, 4)
    ids = list(generate(engine.lm, prompt, lambda logits: int(torch.argmax(logits)), 12, eos_ids=set()))
    stop = ids[4]
    first = ids.index(stop)
    work = Work(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop,)))
    out, _ = run_work(engine, work)
    done = out.done[0]
    assert done.finish_reason == "stop" and done.usage is not None and done.usage.completion_tokens == first + 1
    expected = str(engine.lm.tokenizer.decode(ids[:first], skip_special_tokens=True))
    assert out.texts.get(0, "") == expected.rstrip("\ufffd")  # an unfinished character is never sent


def test_the_stop_tokens_logprobs_are_not_sent_and_every_other_tokens_are(engine: Engine) -> None:
    """As its text: the token that stopped the choice has no entry; each token before it has one (in a delta, or in
    `done` when its text never came, e.g. a held-back half character)."""
    prompt = text_prompt(engine, 4)
    ids = list(generate(engine.lm, prompt, lambda logits: int(torch.argmax(logits)), 12, eos_ids=set()))
    first = ids.index(ids[4])
    work = Work(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(ids[4],),
                                       logprobs=0))
    _, events = run_work(engine, work)
    entries = [entry for e in events for entry in (e.logprobs or [])]
    assert len(entries) == first  # the stop token is the (first + 1)-th generated


def test_echo_sends_the_prompt_first_in_every_choice(engine: Engine) -> None:
    out, events = request(engine, prompt="the red circle", echo=True,
                          sampling=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=2))
    firsts = {i: next(e for e in events if e.index == i) for i in (0, 1)}
    assert all(e.type == "delta" and e.text == "the red circle" and e.logprobs is None for e in firsts.values())
    assert out.texts[0] == out.texts[1] and out.texts[0].startswith("the red circle")


def test_logprobs_ride_on_the_deltas_of_their_tokens(engine: Engine) -> None:
    out, events = request(engine, sampling=SamplingParams(max_tokens=10, temperature=0, logprobs=3))
    entries = [entry for e in events for entry in (e.logprobs or [])]
    done = out.done[0]
    assert done.usage is not None and len(entries) == done.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob == entry.top_logprobs[0].logprob for entry in entries)
    assert "".join(e.text for e in events if e.type == "delta") == out.texts[0]


def test_ids_outside_the_vocabulary_and_echo_with_logprobs_are_400s(engine: Engine) -> None:
    vocab = engine.vocab_size
    cases: list[tuple[dict[str, Any], str]] = [({"prompt": [1, vocab]}, "prompt"),
             ({"messages": USER, "sampling": SamplingParams(logit_bias={vocab: 1.0})}, "logit_bias"),
             ({"messages": USER, "sampling": SamplingParams(stop_token_ids=(vocab + 5,))}, "stop_token_ids"),
             ({"prompt": "hi", "echo": True, "sampling": SamplingParams(logprobs=1)}, "echo")]
    for body, param in cases:
        with pytest.raises(APIError) as err:
            engine.prepare(GenerateRequest(**body))
        assert err.value.status == 400 and err.value.param == param, body


def test_cached_tokens_count_images_held_before_and_decoder_cache_hits(engine: Engine) -> None:
    hidden = int(engine.lm.config.get_text_config().hidden_size)
    refs = [ImageRef(mm_hash="held", cached=True), ImageRef(mm_hash="hit"), ImageRef(mm_hash="new")]
    gathered = [Gathered.of(ImageFeatures(embeds=torch.zeros(n, hidden)), hit)
                for n, hit in ((4, False), (6, True), (3, False))]
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in refs), {"type": "text", "text": "hi"}]}]
    req = GenerateRequest(messages=messages, images=refs, cache_salt="features")
    # held, but this salt never sent them: not counted (decoder_service/image_hits.py); then they are its own
    assert engine.preparer.prepare(req, lambda req: gathered).cached_tokens == 0
    assert engine.preparer.prepare(req, lambda req: gathered).cached_tokens == 10


def test_a_required_tool_call_streams_tool_call_deltas(engine: Engine) -> None:
    out, events = request(engine, tools=[WEATHER], tool_choice=ToolChoice(mode="required", parallel=False),
                          sampling=SamplingParams(max_tokens=120, temperature=0))
    calls = [call for e in events for call in (e.tool_calls or [])]
    assert out.done[0].finish_reason == "tool_calls" and calls[0].name == "get_weather" and calls[0].id
    arguments = json.loads("".join(c.arguments for c in calls if c.index == 0))
    assert arguments["city"] in ("Paris", "Rome")


def test_a_json_schema_output_parses_and_matches(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "boolean"}},
              "required": ["color", "n"], "additionalProperties": False}
    fmt = ResponseFormat(type="json_schema", json_schema=schema, strict=True)
    out, _ = request(engine, response_format=fmt, sampling=SamplingParams(max_tokens=60, temperature=0, n=2))
    for i in (0, 1):
        assert out.done[i].finish_reason == "stop"
        value = json.loads(out.texts[i])
        assert value["color"] in ("red", "blue") and isinstance(value["n"], bool) and set(value) == {"color", "n"}


def test_response_format_with_a_forced_tool_call_is_400(engine: Engine) -> None:
    with pytest.raises(APIError) as err:
        engine.prepare(GenerateRequest(messages=USER, tools=[WEATHER], tool_choice=ToolChoice(mode="required"),
                                       response_format=ResponseFormat(type="json_object")))
    assert err.value.status == 400 and err.value.param == "response_format"


def test_free_streams_are_unchanged_by_constrained_ones_in_their_batch(engine: Engine) -> None:
    """Constrained and free rows share one batched step: the free row's tokens equal its tokens alone."""
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    schema = {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 50}
    constrained = GenerateRequest(messages=USER, sampling=free,
                                  response_format=ResponseFormat(type="json_schema", json_schema=schema))
    alone, _ = request(engine, sampling=free)

    async def together() -> list[Choices]:
        jobs = [engine.submit(engine.prepare(constrained)) for _ in range(3)]
        jobs.insert(1, engine.submit(engine.prepare(GenerateRequest(messages=USER, sampling=free))))
        return list(await asyncio.gather(*(collect_all(j) for j in jobs)))

    outs = asyncio.run(together())
    assert outs[1].texts == alone.texts  # the free row, batched with three constrained ones
    for i in (0, 2, 3):
        assert outs[i].texts[0].startswith('["') and outs[i].texts[0] != alone.texts[0]
    assert engine.runner.rows == {} and engine.runner.num_free_blocks == engine.runner.blocks.num_usable  # every slot freed


class _BreaksAfter:
    """A compiled guide whose matchers allow everything, then refuse the `after`-th token (a grammar bug)."""

    def __init__(self, after: int):
        self.after = after

    def matcher(self) -> Any:
        compiled = self

        class Matcher:
            accepted, terminated = 0, False

            def refused(self, vocab: int, device: torch.device) -> torch.Tensor:
                return torch.zeros(vocab, dtype=torch.bool, device=device)

            def accept(self, token: int) -> None:
                self.accepted += 1
                if self.accepted == compiled.after:
                    raise GuideError("the output broke the response_format grammar", "response_format")

        return Matcher()


def test_a_grammar_that_breaks_mid_stream_ends_its_request_alone(engine: Engine) -> None:
    """Its n choices end with one error event and free their slots; a stream beside it finishes unchanged."""
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone, _ = request(engine, sampling=free)
    broken = Work(text_prompt(engine, 6), msgspec.structs.replace(free, n=2), _BreaksAfter(3))  # type: ignore[arg-type]

    async def together() -> list[Choices]:
        jobs = [engine.submit(broken), engine.submit(engine.prepare(GenerateRequest(messages=USER, sampling=free)))]
        return list(await asyncio.gather(*(collect_all(j) for j in jobs)))

    bad, good = asyncio.run(together())
    assert len(bad.errors) == 1 and bad.errors[0].message and not bad.done  # one error ends both choices
    assert good.texts == alone.texts and good.done[0].finish_reason == "length"
    assert engine.runner.rows == {} and engine.runner.num_free_blocks == engine.runner.blocks.num_usable and engine.scheduler.running == {}
