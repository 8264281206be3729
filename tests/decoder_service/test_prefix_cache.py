"""The engine with its prefix cache: outputs equal the cache-off engine's (greedy, seeded, n > 1), usage reports the
reused tokens as cached_tokens, /health lists the proxy's keys, Prometheus counts hits, misses and tokens saved."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from decoder_service.metrics import DecoderMetrics
from decoder_service.shell import Engine
from epd_contracts.generate import GenerateRequest
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import Result, collect, make_engine

SYSTEM = {"role": "system", "content": "You answer questions about numbers, briefly and politely, in English."}
FIRST = [SYSTEM, {"role": "user", "content": "Count from one to five, then say which is the largest."}]


@pytest.fixture(scope="module")
def engines(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    lm = LanguageHalf(tiny_model_dirs["llava"])
    on, off = make_engine(lm.model_dir, lm), make_engine(lm.model_dir, lm, prefix_cache_bytes=0)
    yield on, off
    on.close()
    off.close()


def ask(engine: Engine, messages: list[dict], params: SamplingParams, **extra: object) -> list[Result]:
    """One request, each of its n choices' events (choice i's events are those with index i)."""
    work = engine.prepare(GenerateRequest(messages=messages, sampling=params, **extra))  # type: ignore[arg-type]

    async def main() -> Result:
        return await collect_all(engine.submit(work), params.n)

    merged = asyncio.run(main())
    return [Result("".join(e.text for e in merged.events if e.index == i and e.type == "delta"),
                   [e for e in merged.events if e.index == i]) for i in range(params.n)]


async def collect_all(job: object, n: int) -> Result:
    out = Result()
    for _ in range(n):
        got = await collect(job)  # type: ignore[arg-type]
        out.events += got.events
    return out


def conversation(engine: Engine, params: SamplingParams, **extra: object) -> tuple[list[str], list[int]]:
    """Turn 1, then turn 2 with turn 1's first answer: every choice's text and turn 2's cached_tokens."""
    one = ask(engine, FIRST, params, **extra)
    second = [*FIRST, {"role": "assistant", "content": one[0].text}, {"role": "user", "content": "And the smallest?"}]
    two = ask(engine, second, params, **extra)
    cached = [r.last.usage.cached_tokens for r in two if r.last.usage is not None]
    return [r.text for r in one + two], cached


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=3, ignore_eos=True)],
                         ids=["greedy", "seeded-n3"])
def test_outputs_equal_the_cache_off_engine_and_turn_two_reports_cached_tokens(
        engines: tuple[Engine, Engine], params: SamplingParams) -> None:
    on, off = engines
    texts_on, cached_on = conversation(on, params, cache_salt=f"case-{params.n}")
    texts_off, cached_off = conversation(off, params, cache_salt=f"case-{params.n}")
    assert texts_on == texts_off and len(set(texts_on)) > 1
    assert cached_off == [0] * params.n
    assert all(c == cached_on[0] > 16 and c % 16 == 0 for c in cached_on)  # whole blocks, the same for every choice


def test_a_salt_isolates_and_health_and_metrics_report_the_cache(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    prefix = on.runner.prefix
    assert prefix is not None
    hits, saved = prefix.hits, prefix.tokens_saved
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ask(on, FIRST, params, cache_salt="tenant-a", prefix_keys=["k-system", "k-first"])
    again = ask(on, FIRST, params, cache_salt="tenant-a")[0].last.usage
    other = ask(on, FIRST, params, cache_salt="tenant-b")[0].last.usage
    assert again is not None and other is not None
    assert again.cached_tokens > 0 and other.cached_tokens == 0  # tenant b cannot see tenant a's prefix
    assert prefix.hits == hits + 1 and prefix.tokens_saved == saved + again.cached_tokens
    summary = on.prefix_summary()
    assert summary["enabled"] and {"k-system", "k-first"} <= set(summary["keys"])  # type: ignore[arg-type]
    assert 0 < summary["bytes"] <= summary["capacity_bytes"]  # type: ignore[operator]
    registry = CollectorRegistry()
    DecoderMetrics(registry, dict).prefix_stats = prefix.stats
    text = generate_latest(registry).decode()
    assert f"epd_decoder_prefix_cache_hits_total {float(prefix.hits)}" in text
    assert f"epd_decoder_prefix_cache_tokens_saved_total {float(prefix.tokens_saved)}" in text
    assert f"epd_decoder_prefix_cache_bytes {float(prefix.nbytes)}" in text
