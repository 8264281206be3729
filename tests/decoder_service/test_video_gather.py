"""A video through the decoder engine: its chunks gathered from two encoders' producers and assembled give the same
prompt and tokens as the whole video from one; a lost chunk is a 409 naming it; held chunks count as cached
tokens; the prefix cache reuses a video's K/V across turns; aggregated, the decoder encodes the video itself."""
from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from decoder_service.aggregated import InlineEncoder
from decoder_service.config import DecoderConfig
from decoder_service.embedding_check import EmbeddingCheck
from decoder_service.metrics import DecoderMetrics
from decoder_service.request import Work
from decoder_service.shell import Engine
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from epd_common.errors import APIError
from epd_contracts.generate import ChunkRef, GenerateRequest, ImageRef
from epd_contracts.hashing import mm_hash
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.video_config import video_config
from tests.decoder_service.engine_run import collect, make_engine
from tests.encoder_service.video_plan import PlannedVideo, plan_video
from tests.factories import make_image, make_video

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision")
VIDEO = make_video(num_frames=12, width=96, height=48, fps=10)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def user(text: str, video: bool = True) -> dict[str, Any]:
    return {"role": "user", "content": [*([{"type": "video"}] if video else []), {"type": "text", "text": text}]}


@dataclass
class Stack:
    """Two encoders holding a video's chunks (chunk k on encoder k % 2), a third holding the whole video, and an
    engine on the same checkpoint."""

    vision: VisionHalf
    plan: PlannedVideo
    producers: list[ECProducer]
    engine: Engine

    def chunked(self, cached: tuple[bool, ...] = (), sources: tuple[int, ...] = ()) -> ImageRef:
        """The video's ImageRef in chunks (chunk k from producer sources[k], default k % 2)."""
        chunks = [ChunkRef(mm_hash=c.mm_hash, source=self.producers[sources[k] if sources else k % 2].address,
                           cached=k < len(cached) and cached[k]) for k, c in enumerate(self.plan.chunks)]
        return ImageRef(mm_hash=self.plan.mm_hash, video=self.plan.part(), chunks=chunks)

    def whole(self, **kw: Any) -> ImageRef:
        return ImageRef(mm_hash=self.plan.mm_hash, source=self.producers[2].address, video=self.plan.part(), **kw)


def build_stack(model_dir: Path, lm: LanguageHalf | None = None, **engine_cfg: Any) -> Stack:
    vision = VisionHalf(model_dir)
    config = video_config(model_dir, vision.adapter.name)
    assert config is not None
    plan = plan_video(VIDEO, config, frames_per_chunk=4, num_frames=9)
    producers = [ECProducer().start() for _ in range(3)]
    workers = [EncoderWorker(vision, p) for p in producers]
    for k, chunk in enumerate(plan.chunks):
        workers[k % 2].execute_mm_encoder([ScheduledEncoderInput(chunk.mm_hash, VIDEO, video=plan.part(chunk))])
    workers[2].execute_mm_encoder([ScheduledEncoderInput(plan.mm_hash, VIDEO, video=plan.part())])
    lm = lm or LanguageHalf(model_dir)
    return Stack(vision, plan, producers, make_engine(model_dir, lm, max_model_len=512, **engine_cfg))


def close(stack: Stack) -> None:
    stop(stack.engine)
    for p in stack.producers:
        p.close()


def stop(engine: Engine) -> None:
    engine.close()
    engine.consumer.close()


def answer(engine: Engine, work: Work) -> tuple[str, int]:
    """The request's text and its cached_tokens."""

    async def main() -> tuple[str, int]:
        out = await collect(engine.submit(work))
        assert out.ok and out.last.usage is not None, out.last
        return out.text, out.last.usage.cached_tokens

    return asyncio.run(main())


def request(video: ImageRef, messages: list[dict[str, Any]] | None = None, **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=messages or [user("What moves?")], images=[video], sampling=GREEDY, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_from_two_producers_give_the_whole_videos_prompt_and_tokens(tiny_model_dirs: dict[str, Path],
                                                                           family: str) -> None:
    stack = build_stack(tiny_model_dirs[family])
    try:
        assert len(stack.plan.chunks) >= 2
        chunked = stack.engine.prepare(request(stack.chunked()))
        whole = stack.engine.prepare(request(stack.whole()))
        assert torch.equal(chunked.prompt.input_ids, whole.prompt.input_ids)
        [a], [b] = chunked.prompt.images, whole.prompt.images
        assert (a.grid_thw, a.span, a.second_per_grid_t) == (b.grid_thw, b.span, b.second_per_grid_t)
        torch.testing.assert_close(a.embeds, b.embeds, rtol=1e-5, atol=1e-6)  # see tests/encoder_service
        video_id = stack.engine.lm.video_token_id
        assert chunked.prompt.input_ids[0].tolist().count(video_id) == a.num_tokens
        text, _ = answer(stack.engine, chunked)
        assert text == answer(stack.engine, whole)[0] and len(set(text)) > 1
    finally:
        close(stack)


@pytest.fixture(scope="module")
def qwen(tiny_model_dirs: dict[str, Path]) -> Iterator[Stack]:
    stack = build_stack(tiny_model_dirs["qwen2_vl"])
    yield stack
    close(stack)


def test_a_lost_chunk_is_a_409_naming_that_chunk(qwen: Stack) -> None:
    """Chunk 1 asked of the producer that never held it: the proxy re-encodes exactly that chunk."""
    sources = tuple(0 for _ in qwen.plan.chunks)  # every chunk from producer 0, which holds the even ones
    with pytest.raises(APIError) as err:
        qwen.engine.prepare(request(qwen.chunked(sources=sources)))
    assert err.value.status == 409 and err.value.code == "missing_embeddings"
    assert err.value.extra["missing"] == [c.mm_hash for k, c in enumerate(qwen.plan.chunks) if k % 2]


def test_held_chunks_are_cached_tokens(qwen: Stack) -> None:
    rows = [qwen.producers[k % 2].get_cache_item(c.mm_hash) for k, c in enumerate(qwen.plan.chunks)]
    first = rows[0].num_tokens  # type: ignore[union-attr]
    video_id = qwen.engine.lm.video_token_id
    qwen.engine.prepare(request(qwen.chunked()))  # held rows count once the salt ("") sent the video before
    work = qwen.engine.prepare(request(qwen.chunked(cached=(True, False))))
    ids = work.prompt.input_ids[0].tolist()
    positions = [i for i, t in enumerate(ids) if t == video_id]
    assert work.cached_tokens == first and work.held_image_positions == tuple(positions[:first])
    assert qwen.engine.prepare(request(qwen.chunked(cached=(False, True)))).held_image_positions == tuple(
        positions[first:])
    assert qwen.engine.prepare(request(qwen.whole(cached=True))).cached_tokens == len(positions)


def test_a_video_for_a_model_without_video_is_a_400(tiny_model_dirs: dict[str, Path], qwen: Stack) -> None:
    engine = make_engine(tiny_model_dirs["llava"])
    try:
        for ref in (qwen.chunked(), qwen.whole()):
            with pytest.raises(APIError) as err:
                engine.prepare(request(ref))
            assert (err.value.status, err.value.code, err.value.param) == (400, "video_not_supported", "images.0")
    finally:
        stop(engine)


def test_a_video_in_a_mixed_prompt_keeps_the_order(qwen: Stack) -> None:
    """An image, then the video in chunks: the items stay in prompt order through the gather and assembly."""
    buf = io.BytesIO()
    make_image(56, 56, "blue").save(buf, format="PNG")
    png = buf.getvalue()
    worker = EncoderWorker(qwen.vision, qwen.producers[2])
    worker.execute_mm_encoder([ScheduledEncoderInput(mm_hash(png), png)])
    image = ImageRef(mm_hash=mm_hash(png), source=qwen.producers[2].address)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                                             {"type": "text", "text": "What moves?"}]}]
    work = qwen.engine.prepare(GenerateRequest(messages=messages, images=[image, qwen.chunked()], sampling=GREEDY))
    assert [im.is_video for im in work.prompt.images] == [False, True]
    whole = qwen.engine.prepare(GenerateRequest(messages=messages, images=[image, qwen.whole()], sampling=GREEDY))
    assert answer(qwen.engine, work)[0] == answer(qwen.engine, whole)[0]


def test_the_prefix_cache_reuses_a_video_across_turns(tiny_model_dirs: dict[str, Path]) -> None:
    """Turn 2 repeats turn 1 (with its video, in chunks) and adds to it: its blocks through the video are reused,
    and every answer equals the cache-off engine's; the same text with another video reuses nothing of it."""
    model_dir = tiny_model_dirs["qwen2_vl"]
    lm = LanguageHalf(model_dir)
    on, off = build_stack(model_dir, lm), build_stack(model_dir, lm, prefix_cache_bytes=0)
    try:
        turns: dict[str, list[tuple[str, int]]] = {}
        for name, stack in (("on", on), ("off", off)):
            first = [user("What moves in this clip?")]
            one = answer(stack.engine, stack.engine.prepare(request(stack.chunked(), first, cache_salt="v")))
            second = [*first, {"role": "assistant", "content": one[0]}, user("And then?", video=False)]
            two = answer(stack.engine, stack.engine.prepare(request(stack.chunked(), second, cache_salt="v")))
            turns[name] = [one, two]
        assert [t for t, _ in turns["on"]] == [t for t, _ in turns["off"]]
        assert turns["off"][1][1] == 0
        work = on.engine.prepare(request(on.chunked(), second, cache_salt="v"))
        ids = work.prompt.input_ids[0].tolist()
        last_video = max(i for i, t in enumerate(ids) if t == lm.video_token_id)
        assert turns["on"][1][1] > last_video  # reused past the video's last token
        # another sampling of the same bytes: another video hash, other rows, nothing of the video reused
        other = plan_video(VIDEO, video_config(model_dir, "qwen2_vl"), frames_per_chunk=64, num_frames=4)  # type: ignore[arg-type]
        EncoderWorker(on.vision, on.producers[2]).execute_mm_encoder(
            [ScheduledEncoderInput(other.mm_hash, VIDEO, video=other.part())])
        ref = ImageRef(mm_hash=other.mm_hash, source=on.producers[2].address, video=other.part())
        first_video = min(i for i, t in enumerate(ids) if t == lm.video_token_id)
        _, cached = answer(on.engine, on.engine.prepare(request(ref, second, cache_salt="v")))
        assert cached <= first_video
    finally:
        close(on)
        close(off)


@pytest.fixture(scope="module")
def inline(qwen: Stack) -> InlineEncoder:
    return InlineEncoder(qwen.vision, cache_bytes=1 << 26, max_image_pixels=1 << 20,
                         check=EmbeddingCheck(qwen.engine.lm))


def inline_ref(plan: PlannedVideo, data: bytes | None = None, **kw: Any) -> ImageRef:
    fields = {"mm_hash": plan.mm_hash, "data": base64.b64encode(data or plan.data).decode(), "video": plan.part(),
              **kw}
    return ImageRef(**fields)


def test_aggregated_encodes_the_whole_video_through_the_encoder_path(qwen: Stack, inline: InlineEncoder) -> None:
    [(features, hit)] = inline.features_and_hits([inline_ref(qwen.plan)])
    held = qwen.producers[2].get_cache_item(qwen.plan.mm_hash)
    assert held is not None and not hit and torch.equal(features.embeds, held.embeds)
    assert (features.grid_thw, features.second_per_grid_t) == (held.grid_thw, held.second_per_grid_t)
    assert inline.features_and_hits([inline_ref(qwen.plan)])[0][1]  # then a hit: cached_tokens
    consumer = ECConsumer()
    cfg = DecoderConfig(max_num_seqs=4, max_prefill_tokens=512, max_model_len=512, aggregated=True)
    engine = Engine(qwen.engine.lm, consumer, cfg, DecoderMetrics(CollectorRegistry(), consumer.stats), inline)
    try:
        engine.prepare(request(inline_ref(qwen.plan)))  # its hit counts once the salt ("") sent it here before
        text, cached = answer(engine, engine.prepare(request(inline_ref(qwen.plan))))
        assert text == answer(qwen.engine, qwen.engine.prepare(request(qwen.whole())))[0]
        assert cached == held.num_tokens
    finally:
        stop(engine)


def test_aggregated_refuses_what_it_cannot_encode(qwen: Stack, inline: InlineEncoder) -> None:
    cases: list[tuple[ImageRef, str, str]] = [
        (inline_ref(qwen.plan, mm_hash="0" * 64), "hash_mismatch", "images.0.mm_hash"),
        (inline_ref(qwen.plan, data=b"not a video"), "hash_mismatch", "images.0.mm_hash"),
        (ImageRef(mm_hash=qwen.plan.chunks[0].mm_hash, data=base64.b64encode(VIDEO).decode(),
                  video=qwen.plan.part(qwen.plan.chunks[0])), "invalid_value", "images.0.video"),
        (ImageRef(mm_hash="", data=base64.b64encode(b"not a video").decode(), video=qwen.plan.part()),
         "invalid_video", "images.0.data"),
    ]
    for ref, code, param in cases:
        with pytest.raises(APIError) as err:
            inline.features([ref])
        assert (err.value.status, err.value.code, err.value.param) == (400, code, param), ref
