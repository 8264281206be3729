"""The decoder's per-request histograms under vLLM's names: each finished choice's queue, prefill and decode time,
and the embedding bytes a request with images gathered."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from decoder_service.config import DecoderConfig
from decoder_service.metrics import DecoderMetrics
from decoder_service.shell import Engine
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import GenerateRequest, ImageRef
from epd_contracts.hashing import mm_hash
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import collect

ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
TEXT = [{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"}]}]
PHASES = ("queue", "prefill", "decode")


@pytest.fixture
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[Engine, CollectorRegistry]]:
    registry, consumer = CollectorRegistry(), ECConsumer()
    eng = Engine(LanguageHalf(tiny_model_dirs["llava"]), consumer, DecoderConfig(max_model_len=512),
                 DecoderMetrics(registry, consumer.stats))
    yield eng, registry
    eng.close()
    consumer.close()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def phase(registry: CollectorRegistry, name: str, sample: str) -> float:
    return value(registry, f"epd_decoder_request_{name}_time_seconds_{sample}")


def answer(eng: Engine, req: GenerateRequest) -> None:
    """Every choice's events, to its `done` (a choice's metrics are observed when it finishes)."""
    async def main() -> None:
        job = eng.submit(eng.prepare(req))
        for _ in range(req.sampling.n):
            out = await collect(job)
            assert out.ok, out.last

    asyncio.run(main())


def test_each_finished_choice_observes_its_queue_prefill_and_decode_time(
        engine: tuple[Engine, CollectorRegistry]) -> None:
    eng, registry = engine
    answer(eng, GenerateRequest(messages=TEXT, sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    assert [phase(registry, p, "count") for p in PHASES] == [1, 1, 1]
    assert phase(registry, "decode", "sum") > 0  # five tokens after the first
    spent = sum(phase(registry, p, "sum") for p in PHASES)
    assert 0 < spent <= value(registry, "epd_decoder_e2e_request_latency_seconds_sum")  # phases within arrival-to-end
    answer(eng, GenerateRequest(messages=TEXT, sampling=SamplingParams(n=2, max_tokens=3, temperature=1, seed=1,
                                                                       ignore_eos=True)))
    assert [phase(registry, p, "count") for p in PHASES] == [3, 3, 3]  # per choice, as e2e is
    assert value(registry, "epd_decoder_e2e_request_latency_seconds_count") == 3
    assert value(registry, "epd_decoder_gathered_bytes_count") == 0  # no images: nothing gathered


def test_a_request_with_an_image_observes_the_bytes_it_gathered(engine: tuple[Engine, CollectorRegistry]) -> None:
    eng, registry = engine
    producer = ECProducer().start()
    try:
        key = mm_hash(b"one image's embeddings")
        feats = ImageFeatures(torch.randn(256, 64))  # the tiny LLaVA's image tokens and LM width
        producer.save_caches(key, feats)
        req = GenerateRequest(messages=ASK, images=[ImageRef(mm_hash=key, source=producer.address)],
                              sampling=SamplingParams(max_tokens=2, temperature=0))
        answer(eng, req)
        assert value(registry, "epd_decoder_gathered_bytes_count") == 1
        assert value(registry, "epd_decoder_gathered_bytes_sum") == feats.nbytes == 256 * 64 * 4
        assert value(registry, "epd_decoder_gathered_bytes_bucket", le="65536.0") == 1  # 64 KiB: in its bound
        assert value(registry, "epd_decoder_gathered_bytes_bucket", le="16384.0") == 0
    finally:
        producer.close()
