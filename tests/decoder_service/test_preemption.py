"""A pool too small for the requests in flight: sequences are preempted and recomputed, and every request still
completes with exactly its solo output (greedy and seeded), for every family; no block is left held."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.sequence import Job
from decoder_service.job_trace import trace_job
from decoder_service.prompt import Prompt, build_prompt
from decoder_service.shell import Engine
from epd_builders.tiny import FAMILIES
from epd_common import tracing
from epd_contracts.hashing import multi_image_item
from epd_contracts.sampling import SamplingParams
from epd_models.chat import chat_template, image_edges, render
from epd_models.halves import LanguageHalf, VisionHalf
from tests.decoder_service.engine_run import make_engine, run
from tests.factories import make_image
from tests.test_tracing_off import exported  # noqa: F401 (the fixture: tracing on in memory)

BLOCK = 16
MAX_TOKENS = 96


def prompts(model_dir: Path, lm: LanguageHalf) -> list[Prompt]:
    """Four short text prompts, then an image prompt: the short ones are all admitted, and their growth runs the pool
    dry (the image prompt, admitted last, is the first preempted)."""
    vision = VisionHalf(model_dir)
    template = chat_template(lm.tokenizer, model_dir)
    out = []
    for words, with_image in ((1, False), (2, False), (3, False), (4, False), (2, True)):
        parts: list[dict] = [{"type": "image"}] if with_image else []
        text = " ".join(["what colour is the shape and why"] * words)
        ids = render(lm.tokenizer, [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], template,
                     image_edges=image_edges(lm))
        images = [make_image(224, 224, "red")] if with_image else []
        feats = vision.encode(images, multi_image=multi_image_item(lm.config.model_type, 1)) if images else []
        out.append(build_prompt(lm, ids, feats))
    return out


def preempting_engine(model_dir: Path, lm: LanguageHalf, all_prompts: list[Prompt], **cfg: Any) -> tuple[Engine, int]:
    """An engine whose K/V pool holds one sequence of max_model_len, not every one's growth."""
    longest = max(p.num_tokens for p in all_prompts) + MAX_TOKENS
    max_len = -(-(longest + 1) // BLOCK) * BLOCK
    blocks = max_len // BLOCK + 1
    per_block = KVShape.of(lm.config.get_text_config(), lm.dtype).bytes_per_block(BLOCK)
    engine = make_engine(model_dir, lm, max_model_len=max_len, kv_cache_memory=(blocks + 1) * per_block,
                         block_size=BLOCK, prefix_cache_bytes=0, **cfg)
    return engine, blocks


def test_a_preempted_choice_is_an_event_pair_on_its_decode_span(  # type: ignore[no-untyped-def]
        tiny_model_dirs: dict[str, Path], exported) -> None:  # noqa: F811
    lm = LanguageHalf(tiny_model_dirs["qwen2_vl"])
    all_prompts = prompts(tiny_model_dirs["qwen2_vl"], lm)
    engine, _ = preempting_engine(tiny_model_dirs["qwen2_vl"], lm, all_prompts)
    jobs: list[Job] = []
    try:
        run(engine, [(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)) for p in all_prompts],
            after_submit=jobs.extend)
    finally:
        engine.close()
    assert engine.scheduler.num_preempted > 0
    (job, *_) = [j for j in jobs if j.decode_events]
    names = [name for name, _, _ in job.decode_events]
    assert names[:2] == ["preempted", "resumed"] and len(names) % 2 == 0
    assert all(a[1] <= b[1] for a, b in zip(job.decode_events, job.decode_events[1:], strict=False))
    with tracing.span("POST /generate", kind="server", parent="00-" + "e" * 32 + "-" + "f" * 16 + "-01"):
        trace_job(job)
    (decode,) = [s for s in exported() if s.name == "decode"]
    assert [e.name for e in decode.events] == names and decode.events[0].attributes["epd.choice"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_sequences_finish_with_their_solo_output(tiny_model_dirs: dict[str, Path], family: str) -> None:
    lm = LanguageHalf(tiny_model_dirs[family])
    all_prompts = prompts(tiny_model_dirs[family], lm)
    engine, blocks = preempting_engine(tiny_model_dirs[family], lm, all_prompts)
    try:
        assert engine.runner.blocks.num_usable == blocks
        specs = [(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7 + i, ignore_eos=True))
                 for i, p in enumerate(all_prompts)]
        solo = [run(engine, [spec])[0] for spec in specs]  # one at a time: one sequence always fits
        assert engine.scheduler.num_preempted == 0 and all(r.ok for r in solo)
        together = run(engine, specs)
        assert engine.scheduler.num_preempted > 0, "the pool was meant to run dry"
        assert [r.answer() for r in together] == [r.answer() for r in solo]
        assert engine.runner.rows == {} and engine.runner.num_free_blocks == blocks and not any(engine.runner.blocks.refs)
    finally:
        engine.close()
