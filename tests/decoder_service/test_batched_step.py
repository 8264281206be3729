"""The decode step's batched postprocess chooses, reads back, detokenizes and streams exactly what the per-row path did."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from decoder_service.engine.detokenizer import window_decoder
from decoder_service.engine.outbox import held_events, outbox
from decoder_service.engine.outputs import RowLogits
from decoder_service.engine.readback import read_back
from decoder_service.engine.sampling import Sampler, choose_rows
from epd_contracts.generate import Event
from epd_contracts.sampling import SamplingParams
from tests.decoder_service.engine_run import greedy, make_engine, run, text_prompt

VOCAB = 50
ROWS: list[dict[str, Any]] = [  # greedy rows batch; the others choose alone, each with its own generator
    {"temperature": 0}, {"temperature": 0}, {"temperature": 0.8, "seed": 3}, {"temperature": 0, "logprobs": 2},
    {"temperature": 0, "frequency_penalty": 1.5}, {"temperature": 1.2, "top_k": 5, "seed": 11}, {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9, "seed": 5, "n": 2}, {"temperature": 0, "logit_bias": {7: 5.0}},
]


def logits_rows(step: int) -> list[torch.Tensor]:
    """Rows of one step's logits, with ties, NaN, +-inf and all-equal rows among them (views of one tensor)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(len(ROWS), VOCAB, generator=g).round(decimals=1)  # rounding makes ties
    x[1, :] = 0.5  # all equal: the first maximum
    x[6, 4] = float("nan")
    x[(step % len(ROWS)), 9] = float("inf")
    x[0, :10] = float("-inf")
    return list(x)


def samplers() -> list[Sampler]:
    table: Any = object()  # logprobs are packed only with the engine's token table (not read here)
    return [Sampler(SamplingParams(**row), index=i % 2, tokens=table) for i, row in enumerate(ROWS)]


def test_batched_choice_is_exactly_the_per_row_choice_greedy_and_seeded() -> None:
    batched, alone = samplers(), samplers()
    assert [s.batched for s in batched] == [True, True, False, False, False, False, True, False, False]
    for step in range(40):
        rows = logits_rows(step)
        picked, batch = choose_rows([(i, s) for i, s in enumerate(batched)], dict(enumerate(rows)))
        assert batch is not None and batch[0] == [0, 1, 6]
        tokens = read_back({k: t for k, t in picked.items() if isinstance(t, torch.Tensor)}, VOCAB, batch)
        expected = {i: int(s.choose(rows[i])) for i, s in enumerate(alone)}
        assert tokens == expected, step
        for i in range(len(ROWS)):  # both paths accept the same token (penalties, seeds move on alike)
            batched[i].accept(expected[i])
            alone[i].accept(expected[i])


def test_a_sampler_that_raises_fails_its_row_alone() -> None:
    good, bad = samplers()[:2]

    def broken(logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")
    bad.choose = broken  # type: ignore[method-assign]
    rows = logits_rows(0)
    picked, batch = choose_rows([(0, good), (1, bad)], dict(enumerate(rows)))
    assert batch is not None and batch[0] == [0] and isinstance(picked[1], RuntimeError)


def test_the_window_decoder_decodes_as_the_tokenizer_does(tiny_model_dirs: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llava"])
    decode = window_decoder(tok)
    assert decode.func == tok.backend_tokenizer.decode  # type: ignore[attr-defined]  # the fast path is taken
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 6))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids


def test_held_events_reach_their_queue_in_order_with_one_wakeup(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.new_event_loop()
    try:
        wakeups: list[object] = []
        real = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            wakeups.append(args)
            return real(*args)
        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        with held_events():
            for i in range(5):
                outbox(loop).put(queue, Event(type="delta", text=str(i)))
            assert not wakeups and queue.empty()  # held until the block ends
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakeups) == 1 and [queue.get_nowait().text for _ in range(5)] == ["0", "1", "2", "3", "4"]
    finally:
        loop.close()
    with pytest.raises(RuntimeError):  # a closed loop refuses the event, so its request fails (as before)
        outbox(loop).put(queue, Event(type="delta", text="late"))


def test_an_engine_step_of_greedy_rows_chooses_in_one_batch_and_matches_each_row_alone(
        tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny_model_dirs["llava"])
    try:
        specs = [(text_prompt(engine, w), greedy(16)) for w in (1, 3, 5, 8)]
        alone = [run(engine, [spec])[0].answer() for spec in specs]
        calls: list[int] = []
        real = Sampler.choose

        def counted(self: Sampler, logits: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return real(self, logits)
        monkeypatch.setattr(Sampler, "choose", counted)
        together = [r.answer() for r in run(engine, specs)]
    finally:
        engine.close()
    assert together == alone and not calls  # every greedy row chose in the batched argmax


def test_the_runners_logits_matrix_gives_the_same_choices_as_rows() -> None:
    """RowLogits hands the batched argmax the forward's matrix itself, a subset of it (index_select) or rows of
    several tensors (a stack): every way, the same tokens as row by row."""
    for step in range(10):
        rows = logits_rows(step)
        matrix = torch.stack(rows)
        for keep in (range(len(ROWS)), [0, 1, 6], [6, 0]):
            logits = RowLogits()
            logits.put_rows(list(range(len(ROWS))), matrix)
            logits[100] = rows[2].clone()  # a prompt's own last logits
            logits.alias(101, 100)  # its fork
            keys = [*keep, 100, 101]
            assert (logits.rows_of(list(range(len(ROWS)))) is matrix) and torch.equal(logits[2], rows[2])
            fresh = {i: Sampler(SamplingParams(temperature=0.0)) for i in keys}
            picked, batch = choose_rows([(k, fresh[k]) for k in keys], logits)
            assert not picked and batch is not None and batch[0] == keys
            assert batch[1].tolist() == [int(torch.argmax(logits[k])) for k in keys]
