"""Engine: requests that cannot run are refused before they start, with the right status."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from connector.tensors.consumer import ECConsumer
from decoder_service.config import DecoderConfig
from decoder_service.metrics import DecoderMetrics
from decoder_service.shell import Engine
from decoder_service.state import DecoderState
from epd_common.errors import APIError
from epd_contracts.generate import GenerateRequest, ImageRef
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from epd_models.identity import model_identity

USER = [{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"}]}]


@pytest.fixture
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[Engine]:
    consumer = ECConsumer()
    eng = Engine(LanguageHalf(tiny_model_dirs["llava"]), consumer, DecoderConfig(max_model_len=64, gather_timeout=0.3),
                 DecoderMetrics(CollectorRegistry(), consumer.stats))
    yield eng
    eng.close()
    consumer.close()


def test_prompt_plus_max_tokens_over_model_length_is_400(engine: Engine) -> None:
    with pytest.raises(APIError) as err:
        engine.prepare(GenerateRequest(messages=USER, sampling=SamplingParams(max_tokens=1000)))
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"


def test_unset_max_tokens_fills_the_remaining_context(engine: Engine) -> None:
    work = engine.prepare(GenerateRequest(messages=USER))
    assert work.params.max_tokens == 64 - work.prompt.num_tokens


def test_embedding_found_nowhere_is_409_listing_it(engine: Engine) -> None:
    ref = ImageRef(mm_hash="gone", source="tcp://127.0.0.1:9")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(APIError) as err:
        engine.prepare(GenerateRequest(messages=msgs, images=[ref]))
    assert err.value.status == 409 and err.value.extra["missing"] == ["gone"]


def test_image_marker_count_must_match_images(engine: Engine) -> None:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(APIError) as err:
        engine.prepare(GenerateRequest(messages=msgs))
    assert err.value.status == 400 and "placeholder" in err.value.message


def test_a_prompt_too_long_for_the_model_is_refused_before_the_gather(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def no_gather(req: GenerateRequest) -> list[object]:
        raise AssertionError("gathered for a prompt that cannot fit")

    monkeypatch.setattr(engine, "_gather", no_gather)
    long = [{"role": "user", "content": [{"type": "text", "text": "describe the picture " * 400}]}]
    with pytest.raises(APIError) as err:
        engine.prepare(GenerateRequest(messages=long))
    assert err.value.status == 400 and err.value.code == "context_length_exceeded" and err.value.param == "messages"


def test_health_reports_the_model_identity(decoder: tuple[str, DecoderState]) -> None:
    url, ref = decoder
    body = httpx.get(f"{url}/health").json()
    assert body["model_identity"] == model_identity(ref.engine.lm.model_dir, ref.cfg.model)
    assert body["model_identity"]["hidden_size"] == 64 and body["model_identity"]["family"] == "llava"
