"""Admission and preemption are fair across clients (a client: its cache_salt).

24 long requests of one client on a pool that holds a few of them preempt each other; a short request of another
client coming meanwhile is admitted before the attacker's requests still waiting (not queued behind every earlier
long one), answers exactly what it answers alone, and memory stays bounded; every attacking request still
completes.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from decoder_service.engine.kv_shape import KVShape
from decoder_service.shell import Engine
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import greedy, make_engine, run, text_prompt
from tests.hostile.engine_attack import MEMORY_BOUND, attack
from tests.hostile.memory import rss_bytes

BLOCK = 16
ATTACKERS = 24
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def engine(tiny_model_dirs: dict[str, Path]) -> Iterator[Engine]:
    """A pool of 4 sequences of 256 positions, 32 rows."""
    lm = LanguageHalf(tiny_model_dirs["llava"])
    per_block = KVShape.of(lm.config.get_text_config(), lm.dtype).bytes_per_block(BLOCK)
    eng = make_engine(tiny_model_dirs["llava"], lm, max_num_seqs=32, max_model_len=256, block_size=BLOCK,
                      kv_cache_memory=(4 * 256 // BLOCK + 1) * per_block, max_prefill_tokens=64)
    yield eng
    eng.close()


def test_a_short_request_of_another_client_is_not_queued_behind_every_long_one(engine: Engine) -> None:
    long_prompt = [p for w in range(1, 40) if (p := text_prompt(engine, w)).num_tokens <= 128][-1]
    victim = (text_prompt(engine, 1), greedy(8))
    [solo] = run(engine, [victim])
    before = rss_bytes()
    got = attack(engine, [(long_prompt, greedy(MAX_TOKENS))] * ATTACKERS, victim, started=0)
    assert got.victim.ok and got.victim.answer() == solo.answer()
    assert got.unadmitted_at_first_token > 0  # it went ahead of attacking requests still waiting
    assert all(r.events[-1].type == "done" and r.events[-1].finish_reason == "length" for r in got.attackers)
    assert engine.scheduler.num_preempted > 0  # the attack did run the pool dry
    assert rss_bytes() - before < MEMORY_BOUND
