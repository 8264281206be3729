"""LoRA adapters and the prefix cache: a block computed under one adapter (or the base model) is never reused under
another, and is reused under its own; a request naming an adapter the decoder does not serve is a 400 naming `model`
before any work; /health lists the adapters (what the proxy routes by)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decoder_service.shell import Engine
from epd_common.errors import APIError
from epd_common.lora_flags import LoRAModule
from epd_contracts.generate import GenerateRequest
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import greedy, make_engine
from tests.decoder_service.test_prefix_cache import FIRST, ask
from tests.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def engine(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model_dir = tiny_model_dirs["llava"]
    folder = tmp_path_factory.mktemp("loras")
    modules = tuple(LoRAModule(n, str(make_adapter(model_dir, folder / n, seed=i))) for i, n in enumerate("ab"))
    eng = make_engine(model_dir, LanguageHalf(model_dir), enable_lora=True, max_loras=2, lora_modules=modules)
    yield eng
    eng.close()


def cached(engine: Engine, lora: str) -> tuple[str, int]:
    [r] = ask(engine, FIRST, greedy(8), lora=lora)
    assert r.last.usage is not None
    return r.text, r.last.usage.cached_tokens


def test_prefix_blocks_are_reused_only_under_the_adapter_that_computed_them(engine: Engine) -> None:
    base, none_cached = cached(engine, "")
    assert none_cached == 0
    a1, a_first = cached(engine, "a")
    a2, a_again = cached(engine, "a")
    b1, b_first = cached(engine, "b")
    base2, base_again = cached(engine, "")
    assert a_first == 0 and b_first == 0  # the base model's blocks, then a's, are not theirs
    assert a_again > 0 and base_again > 0  # each reuses its own
    assert a1 == a2 and base == base2 and len({base, a1, b1}) == 3


def test_an_adapter_not_served_is_a_400_naming_model(engine: Engine) -> None:
    with pytest.raises(APIError) as exc:
        engine.prepare(GenerateRequest(messages=FIRST, sampling=greedy(4), lora="nope"))
    assert exc.value.status == 400 and exc.value.param == "model" and "'a', 'b'" in exc.value.message


def test_health_lists_the_adapters(engine: Engine) -> None:
    assert engine.lm.lora is not None
    assert [(a["name"], a["rank"]) for a in engine.lm.lora.describe()] == [("a", 8), ("b", 8)]
