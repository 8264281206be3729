"""The seed's regressions: the encoder encodes and caches by mm_hash, never gathers, and never crashes."""
from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from epd_models.halves import VisionHalf
from scheduler.scheduler import EncoderSlot, MMItem, Scheduler
from tests.factories import make_image


def png(color: str, size: int = 96) -> bytes:
    buf = io.BytesIO()
    make_image(size, size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def producers() -> Iterator[list[ECProducer]]:
    ps = [ECProducer().start(), ECProducer().start()]
    yield ps
    for p in ps:
        p.close()


@pytest.fixture(autouse=True)
def no_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any gather from an encoder is the seed's bug: make it fail loudly."""

    def gather(*args: object, **kwargs: object) -> None:
        raise AssertionError("an encoder must never gather")

    monkeypatch.setattr(ECConsumer, "gather", gather)


def make_worker(model_dir: Path, producer: ECProducer) -> EncoderWorker:
    return EncoderWorker(VisionHalf(model_dir), producer)


def test_execute_mm_encoder_caches_outputs_without_gathering(tiny_model_dirs: dict[str, Path],
                                                             producers: list[ECProducer]) -> None:
    worker = make_worker(tiny_model_dirs["qwen2_vl"], producers[0])
    data = png("red")
    done = worker.execute_mm_encoder([ScheduledEncoderInput("h-red", data)])
    held = producers[0].get_cache_item("h-red")
    assert held is not None and done[0].num_tokens == held.num_tokens and done[0].grid_thw == held.grid_thw
    expected = worker.vision.encode([make_image(96, 96, "red")])[0]
    assert torch.equal(held.embeds, expected.embeds)
    assert worker.num_encoded == 1 and not done[0].cached


def test_execute_mm_encoder_is_a_noop_without_scheduled_items(tiny_model_dirs: dict[str, Path],
                                                             producers: list[ECProducer],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_worker(tiny_model_dirs["llava"], producers[0])
    calls: list[object] = []
    monkeypatch.setattr(worker.vision, "encode", lambda images: calls.append(images))
    assert worker.execute_mm_encoder([]) == []
    assert calls == [] and worker.num_encoded == 0 and producers[0].stats()["num_items"] == 0


def test_item_already_held_is_not_encoded_again(tiny_model_dirs: dict[str, Path], producers: list[ECProducer],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_worker(tiny_model_dirs["llava"], producers[0])
    worker.execute_mm_encoder([ScheduledEncoderInput("h", png("blue"))])
    monkeypatch.setattr(worker.vision, "encode", lambda images: pytest.fail("re-encoded a held item"))
    (again,) = worker.execute_mm_encoder([ScheduledEncoderInput("h", png("blue"))])
    assert again.cached and again.num_tokens == 256


def test_encoder_asked_for_a_request_whose_items_another_encoder_holds_does_not_crash(
        tiny_model_dirs: dict[str, Path], producers: list[ECProducer]) -> None:
    a, b = (make_worker(tiny_model_dirs["qwen2_vl"], p) for p in producers)
    a.execute_mm_encoder([ScheduledEncoderInput("held-by-a", png("red"))])
    sched = Scheduler([EncoderSlot(f"e{i}", p.address, p) for i, p in enumerate(producers)])
    out = sched.schedule([MMItem("held-by-a", png("red")), MMItem("new", png("green"))])
    assert out.skipped == ["held-by-a"] and out.sources["held-by-a"] == producers[0].address
    # b runs its share of the request (possibly nothing) and, asked directly, encodes a's item itself
    for name, items in out.scheduled_encoder_inputs.items():
        worker = {"e0": a, "e1": b}[name]
        worker.execute_mm_encoder([ScheduledEncoderInput(i.mm_hash, i.data) for i in items])
    assert b.execute_mm_encoder([]) == []
    (item,) = b.execute_mm_encoder([ScheduledEncoderInput("held-by-a", png("red"))])
    assert item.num_tokens > 0 and producers[1].has_cache_item("held-by-a")
    assert any(p.has_cache_item("new") for p in producers)
