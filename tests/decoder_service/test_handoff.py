"""E -> P -> D inside one process: a request prefilled by one engine (its first token streamed, its K/V kept) and
continued by another over the received blocks gives token for token what one engine gives alone, for every family
(images, M-RoPE, DeepStack, Gemma 3's masks), greedy, seeded, n > 1 and logprobs; and so does one whose blocks
never arrive (the decode engine prefills the prompt itself). Blocks that are not this model's are refused."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from decoder_service.engine.kv_blocks import KVRefused, check_blocks
from decoder_service.engine.prefix_hash import PrefixChain, prompt_chain
from decoder_service.handoff import HandoffOut, Resume, resume_from
from decoder_service.prompt import Prompt
from decoder_service.request import Work
from decoder_service.shell import Engine
from epd_builders.tiny import FAMILIES
from epd_contracts.generate import Event, GenerateRequest, Handoff, HandoffChoice, ResponseFormat, ToolChoice
from epd_contracts.kv import KVChoice, KVLayout
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import make_engine
from tests.decoder_service.test_preemption import prompts

MAX_TOKENS = 24


@dataclass
class MemoryStore:
    """What a prefill worker keeps (connector/tensors/kv_store.py's `put`), fetched in process."""

    kept: dict[str, Any] = field(default_factory=dict)
    fail: bool = False  # every fetch fails (the prefill worker is gone)
    asked_from: list[int] = field(default_factory=list)  # each fetch's first_block

    def put(self, key: str, layout: KVLayout, num_tokens: int, blocks: torch.Tensor, choices: list[KVChoice]) -> bool:
        self.kept[key] = SimpleNamespace(layout=layout, num_tokens=num_tokens, num_blocks=blocks.shape[0],
                                         first_block=0, blocks=blocks, choices=choices)
        return True

    def fetch(self, address: str, key: str, layout: KVLayout, first_block: int = 0, timeout: float = 10.0) -> Any:
        if self.fail:
            raise ConnectionError("the prefill worker is gone")
        got = self.kept[key]
        assert got.layout == layout and address == "mem://prefill"
        self.asked_from.append(first_block)
        return SimpleNamespace(**{**vars(got), "first_block": first_block, "blocks": got.blocks[first_block:]})


@dataclass
class Stream:
    texts: dict[int, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def add(self, event: Event) -> None:
        self.events.append(event)
        if event.type == "delta":
            self.texts[event.index] = self.texts.get(event.index, "") + event.text

    def done(self) -> dict[int, tuple[str | None, int | None]]:
        return {e.index: (e.finish_reason, e.usage.completion_tokens if e.usage else None)
                for e in self.events if e.type == "done"}

    def per_choice(self) -> dict[int, list[tuple[Any, ...]]]:
        """Each choice's events as the client sees them (a hand-off's own event and cached_tokens aside)."""
        out: dict[int, list[tuple[Any, ...]]] = {}
        for e in self.events:
            if e.type != "handoff":
                usage = None if e.usage is None else (e.usage.prompt_tokens, e.usage.completion_tokens)
                out.setdefault(e.index, []).append((e.type, e.text, e.logprobs, e.tool_calls, e.finish_reason, usage))
        return out

    def logprobs(self) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for e in self.events:
            out.setdefault(e.index, []).extend(e.logprobs or [])
        return out


def run_one(engine: Engine, work: Work, dones: int) -> Stream:
    async def main() -> Stream:
        job = engine.submit(work)
        out, left = Stream(), dones
        while left:
            event = await asyncio.wait_for(job.events.get(), 60)
            out.add(event)
            if event.type in ("handoff", "error"):
                break
            left -= event.type == "done"
        return out
    return asyncio.run(main())


def prefill_then_decode(engine: Engine, store: MemoryStore, prompt: Prompt, params: SamplingParams,
                        key: str) -> tuple[Stream, Stream, Resume]:
    first = run_one(engine, Work(prompt, params, handoff_key=key), params.n)
    handoff = first.events[-1].handoff
    assert first.events[-1].type == "handoff" and handoff is not None and handoff.source == "mem://prefill"
    resume = resume_from(handoff, prompt.num_tokens, store.fetch, engine.kv_layout, engine.runner.shape, 10.0)
    rest = run_one(engine, Work(prompt, params, resume=resume), resume.rows)
    return first, rest, resume


def chain_of(engine: Engine, prompt: Prompt) -> PrefixChain | None:
    """The prompt's prefix-cache keys, as the preparer makes them (its images named img0, img1, ...)."""
    return prompt_chain(prompt.input_ids[0].tolist(), engine.runner.block_size, "", engine.lm.image_token_id,
                        [(f"img{i}", im.num_tokens) for i, im in enumerate(prompt.images)],
                        video_token_id=engine.lm.video_token_id)


def handoff_engine(model_dir: Path, lm: LanguageHalf, store: MemoryStore, **cfg: Any) -> Engine:
    engine = make_engine(model_dir, lm, **{"prefix_cache_bytes": 0, "max_model_len": 2048, "handoff_min_tokens": 0,
                                           **cfg})
    engine.handoff_out = HandoffOut(store, lambda: "mem://prefill", engine.kv_layout)
    engine.kv_fetch = store.fetch
    return engine


CASES = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, ignore_eos=True),
    "n2-logprobs": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, n=2, ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_handed_off_request_continues_token_for_token(tiny_model_dirs: dict[str, Path], family: str,
                                                        device: str) -> None:
    """On --device cuda (make gpu-check) too: the blocks leave and enter the block-major CUDA pool."""
    lm = LanguageHalf(tiny_model_dirs[family], device=device)
    image_prompt = prompts(tiny_model_dirs[family], lm)[-1]  # an image, then text
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs[family], lm, store)
    try:
        for name, params in CASES.items():
            alone = run_one(engine, Work(image_prompt, params), params.n)
            first, rest, resume = prefill_then_decode(engine, store, image_prompt, params, f"{family}-{name}")
            assert resume.kv is not None, resume.why
            joined = {i: first.texts.get(i, "") + rest.texts.get(i, "") for i in range(params.n)}
            assert joined == {i: alone.texts.get(i, "") for i in range(params.n)}, name
            assert rest.done() == alone.done(), name
            both = {i: first.per_choice().get(i, []) + rest.per_choice().get(i, []) for i in range(params.n)}
            assert both == alone.per_choice(), name  # event for event, as one engine streams them
            if params.logprobs is not None:
                both = {i: first.logprobs().get(i, []) + rest.logprobs().get(i, []) for i in range(params.n)}
                assert both == alone.logprobs(), name
        assert engine.runner.rows == {} and not any(engine.runner.blocks.refs)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3"])
def test_a_request_whose_blocks_never_arrive_is_prefilled_by_the_decode_engine(
        tiny_model_dirs: dict[str, Path], family: str) -> None:
    lm = LanguageHalf(tiny_model_dirs[family])
    image_prompt = prompts(tiny_model_dirs[family], lm)[-1]
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs[family], lm, store)
    try:
        params = CASES["seeded"]
        alone = run_one(engine, Work(image_prompt, params), 1)
        store.fail = True
        first, rest, resume = prefill_then_decode(engine, store, image_prompt, params, "lost")
        assert resume.kv is None and "gone" in resume.why
        assert first.texts.get(0, "") + rest.texts.get(0, "") == alone.texts[0] and rest.done() == alone.done()
    finally:
        engine.close()


def test_blocks_that_are_not_this_models_are_refused(tiny_model_dirs: dict[str, Path]) -> None:
    lm = LanguageHalf(tiny_model_dirs["qwen2_vl"])
    engine = make_engine(tiny_model_dirs["qwen2_vl"], lm)
    try:
        layout, shape = engine.kv_layout, engine.runner.shape
        good = torch.zeros(2, *layout.block_shape, dtype=shape.dtype)
        check_blocks(good, layout, shape, layout.block_size, 20)
        handoff = Handoff(key="k", source="mem://prefill", num_tokens=20, choices=[HandoffChoice(first_token=1)])
        fine = SimpleNamespace(num_tokens=20, num_blocks=2, first_block=0, blocks=good, choices=[KVChoice(first_token=1)])
        assert resume_from(handoff, 20, lambda *a, **k: fine, layout, shape, 1.0).kv is good  # the control case
        bad_values = good.clone()
        bad_values[1, 0, 0, 0, 0, 0] = float("nan")
        cases = {"non-finite": (bad_values, layout, 20),
                 "dtype": (good.to(torch.float16) if shape.dtype != torch.float16 else good.float(), layout, 20),
                 "shape": (torch.zeros(2, *layout.block_shape[:-1], layout.head_dim + 1, dtype=shape.dtype), layout, 20),
                 "too many blocks": (good, layout, 16),
                 "other layout": (good, KVLayout(**{**{f: getattr(layout, f) for f in layout.__struct_fields__},
                                                    "kv_heads": layout.kv_heads + 1}), 20)}
        for name, (data, lay, tokens) in cases.items():
            with pytest.raises(KVRefused):
                check_blocks(data, lay, shape, layout.block_size, tokens)
            if name in ("non-finite", "other layout"):  # KVClient refuses these on the wire (tests/connector)
                continue
            handoff = Handoff(key="k", source="mem://prefill", num_tokens=tokens, choices=[HandoffChoice(first_token=1)])
            fake = SimpleNamespace(num_tokens=tokens, num_blocks=-(-tokens // layout.block_size), first_block=0,
                                   blocks=data, choices=[KVChoice(first_token=1)])
            resume = resume_from(handoff, tokens, lambda *a, f=fake, **k: f, layout, shape, 1.0)
            assert resume.kv is None and "KVRefused" in resume.why, name  # refused: the prompt is prefilled here
        # blocks whose first tokens are not the hand-off's (another prompt's, or a stale key's): never resumed from
        two = Handoff(key="k", source="mem://prefill", num_tokens=20,
                      choices=[HandoffChoice(first_token=1), HandoffChoice(), HandoffChoice(first_token=3)])
        for firsts in ([1, 4], [4, 3], [3, 1], [1]):
            other = SimpleNamespace(num_tokens=20, num_blocks=2, first_block=0, blocks=good,
                                    choices=[KVChoice(first_token=t) for t in firsts])
            resume = resume_from(two, 20, lambda *a, f=other, **k: f, layout, shape, 1.0)
            assert resume.kv is None and "first tokens are not the hand-off's" in resume.why, firsts
        same = SimpleNamespace(**{**vars(fine), "choices": [KVChoice(first_token=1), KVChoice(first_token=3)]})
        assert resume_from(two, 20, lambda *a, **k: same, layout, shape, 1.0).kv is good  # the control case
    finally:
        engine.close()


USER = [{"role": "user", "content": "What is the weather like? Answer in JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                           "required": ["city"], "additionalProperties": False}}}
GUIDED = {
    "json": {"response_format": ResponseFormat(type="json_object")},
    "tool": {"tools": [WEATHER], "tool_choice": ToolChoice(mode="required")},
}


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("kind", GUIDED)
def test_structured_outputs_and_tool_calls_continue_from_the_first_token(
        tiny_model_dirs: dict[str, Path], family: str, kind: str) -> None:
    """The decode side's grammar replays the first token: the output still matches, chunk for chunk."""
    lm = LanguageHalf(tiny_model_dirs[family])
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs[family], lm, store)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3)
    try:
        req = GenerateRequest(messages=USER, sampling=sampling, **GUIDED[kind])  # type: ignore[arg-type]
        alone = run_one(engine, engine.prepare(req), 1)
        first = run_one(engine, engine.prepare(msgspec.structs.replace(req, handoff_key=f"{family}-{kind}")), 1)
        handoff = first.events[-1].handoff
        assert handoff is not None
        rest = run_one(engine, engine.prepare(msgspec.structs.replace(req, handoff=handoff)), 1)
        assert first.per_choice().get(0, []) + rest.per_choice()[0] == alone.per_choice()[0]
        assert engine.metrics.handoffs.labels("kv")._value.get() == 1
    finally:
        engine.close()


def test_refused_blocks_leave_the_other_streams_unchanged(tiny_model_dirs: dict[str, Path]) -> None:
    """A hand-off whose blocks were refused (non-finite values from a broken or hostile prefill worker) is prefilled
    here; a stream decoding beside it gets exactly what it gets alone, the refused one what it would have, and no
    block stays held."""
    lm = LanguageHalf(tiny_model_dirs["qwen2_vl"])
    bystander, handed = prompts(tiny_model_dirs["qwen2_vl"], lm)[0], prompts(tiny_model_dirs["qwen2_vl"], lm)[-1]
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs["qwen2_vl"], lm, store)
    params = CASES["seeded"]
    try:
        solo = run_one(engine, Work(bystander, params), 1)
        first = run_one(engine, Work(handed, params, handoff_key="poisoned"), 1)
        handoff = first.events[-1].handoff
        assert handoff is not None
        # KVClient refuses non-finite blocks (tests/connector/test_kv_hostile.py): the request is prefilled here
        refused = Resume(handoff, None, "KVUnavailable: a block holds non-finite values")

        async def together() -> tuple[Stream, Stream]:
            jobs = [engine.submit(Work(bystander, params)), engine.submit(Work(handed, params, resume=refused))]
            outs = []
            for job in jobs:
                out = Stream()
                while True:
                    event = await asyncio.wait_for(job.events.get(), 60)
                    out.add(event)
                    if event.type in ("done", "error"):
                        break
                outs.append(out)
            return outs[0], outs[1]

        alone = run_one(engine, Work(handed, params), 1)
        beside, rest = asyncio.run(together())
        assert beside.per_choice() == solo.per_choice()
        assert first.per_choice().get(0, []) + rest.per_choice()[0] == alone.per_choice()[0]
        assert engine.runner.rows == {} and not any(engine.runner.blocks.refs)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_blocks_the_decoder_holds_under_the_same_prefix_are_not_sent(tiny_model_dirs: dict[str, Path],
                                                                      family: str) -> None:
    """The decode engine's prefix cache holds the prompt's first blocks (an earlier request): only the rest travel,
    and the request still continues token for token."""
    lm = LanguageHalf(tiny_model_dirs[family])
    image_prompt = prompts(tiny_model_dirs[family], lm)[-1]
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs[family], lm, store, prefix_cache_bytes=1 << 26)
    params = CASES["seeded"]
    try:
        alone = run_one(engine, Work(image_prompt, params, chain=chain_of(engine, image_prompt)), 1)  # names the prefix
        first = run_one(engine, Work(image_prompt, params, handoff_key="k", chain=chain_of(engine, image_prompt)), 1)
        handoff = first.events[-1].handoff
        assert handoff is not None
        work = engine.continue_from(Work(image_prompt, params, chain=chain_of(engine, image_prompt)), handoff)
        assert work.resume is not None and work.resume.kv is not None and work.resume.first_block > 0
        assert store.asked_from == [work.resume.first_block]
        full = -(-image_prompt.num_tokens // engine.runner.block_size)
        assert work.resume.kv.shape[0] == full - work.resume.first_block  # only the blocks not held here
        rest = run_one(engine, work, 1)
        assert first.per_choice().get(0, []) + rest.per_choice()[0] == alone.per_choice()[0]
    finally:
        engine.close()
