"""A continued request whose K/V could not be had (its prefill worker died) prefills on the decode
worker at a fresh prompt's budget."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.step_inputs import Segment
from decoder_service.handoff import resume_from
from decoder_service.request import Work
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import greedy, text_prompt
from tests.decoder_service.test_handoff import CASES, MemoryStore, Stream, handoff_engine, run_one


def test_a_prompt_whose_blocks_were_lost_prefills_at_a_fresh_prompts_budget(tiny_model_dirs: dict[str, Path],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill worker died, so its prompt is prefilled on the decode worker beside a decoding
    stream: at the budget the prompt had there (--max-num-batched-tokens, nothing decodes on a prefill worker), not
    --max-prefill-tokens a step; and it continues exactly as it would have."""
    lm = LanguageHalf(tiny_model_dirs["llava"])
    store = MemoryStore()
    engine = handoff_engine(tiny_model_dirs["llava"], lm, store, max_prefill_tokens=32, max_num_batched_tokens=2048)
    try:
        prompt, params = text_prompt(engine, 60), CASES["greedy"]
        assert 256 < prompt.num_tokens < 2048 - 8
        alone = run_one(engine, Work(prompt, params), 1)
        first = run_one(engine, Work(prompt, params, handoff_key="lost"), 1)
        assert first.events[-1].handoff is not None
        store.fail = True
        resume = resume_from(first.events[-1].handoff, prompt.num_tokens, store.fetch, engine.kv_layout,
                             engine.runner.shape, 10.0)
        assert resume.kv is None
        chunks: list[int] = []
        segments = ModelRunner._prefill_segments

        def spied(self: ModelRunner, budget: int) -> list[Segment]:
            out = segments(self, budget)
            chunks.extend(s.num for s in out if s.row.resumed)
            return out

        monkeypatch.setattr(ModelRunner, "_prefill_segments", spied)

        async def beside_a_stream() -> Stream:
            bystander = engine.submit(Work(text_prompt(engine, 1), greedy(400)))
            assert (await asyncio.wait_for(bystander.events.get(), 60)).type == "delta"  # it decodes
            job, out = engine.submit(Work(prompt, params, resume=resume)), Stream()
            while (event := await asyncio.wait_for(job.events.get(), 60)).type == "delta":
                out.add(event)
            out.add(event)
            bystander.cancelled.set()
            return out

        rest = asyncio.run(beside_a_stream())
        assert sum(chunks) == prompt.num_tokens and max(chunks) > 32  # not --max-prefill-tokens a step
        assert first.texts.get(0, "") + rest.texts.get(0, "") == alone.texts[0] and rest.done() == alone.done()
    finally:
        engine.close()
