"""Speculative decoding and chunked prefill at real shapes: what `make gpu-check` records per family beside its engine
numbers (epd_bench/gpu_check_engine.py runs `measure_spec` on the runner it measured, CUDA graphs and all).

- Verification ÷ plain decode, at 1 and at 16 rows of 32-token prompts: the mean time of plain decode steps (each row
  fed one token: the engine's step, replaying its CUDA graph) and of verification steps (each row fed its pending
  token and K = 4 drafts: one query of K + 1 positions over its paged K/V, all rows in one forward, eager as in the
  engine, then the greedy check's one batched argmax read back), each step timed alone between device syncs. After
  each verification the row's length is set back by K + 1 (every draft rejected), so every step verifies the same
  positions. Also the plain step without graphs (eager), the forward alone. With n-gram drafts (no device work) the
  speed-up is (1 + drafts accepted per verification) ÷ (verification ÷ decode).
- The n-gram proposer's host time per row per step: decoder_service/engine/spec/ngram.py `propose` over a
  HISTORY-token history, K tokens, the default n-gram lengths; random text (at a real vocabulary the last token
  rarely recurs: no match) and a repeated passage (the longest n-gram matches).
- Chunked prefill under the engine's defaults: a step of 16 decode rows plus a prompt chunk ÷ a decode-only step of
  the 16 rows: what a decoding stream's inter-token latency pays in a step where a prompt arrives. New default: the
  step's whole token budget (--max-num-batched-tokens, 2,048) less its decode rows, a fresh prompt prefilled whole
  each step; old default: OLD_CHUNK tokens a step of one long prompt.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from epd_bench.micro import sync

if TYPE_CHECKING:
    from decoder_service.engine.model_runner import ModelRunner
    from epd_models.halves import LanguageHalf

K = 4  # drafts per row (vLLM's and --speculative-config's num_speculative_tokens default)
BATCHES = (1, 16)  # rows verifying at once
MIXED_ROWS = 16  # decode rows beside the prompt chunk
OLD_CHUNK = 32  # the step's prefill budget before chunked prefill became the default
HISTORY = 2000  # tokens the n-gram proposer looks over
NGRAM_CALLS = 2000
PROMPT_TOKENS = 32  # each decoding row's prompt (gpu_check_engine's)
DRAFT_FAMILY = "qwen2.5-vl-3b"  # the smallest model gpu-check builds: its plain step x K stands in for a draft model


def spare_tokens(steps: int, step_tokens: int) -> int:
    """Positions measure_spec takes beyond the engine's own runs (the CPU runner is sized for just what it runs)."""
    rows = MIXED_ROWS * (PROMPT_TOKENS + 3 * (steps + 2) + K + 1 + 16)  # + a partial block each
    return rows + max(step_tokens, OLD_CHUNK * (steps + 2) + 1) + 16


def measure_spec(runner: ModelRunner, lm: LanguageHalf, steps: int, step_tokens: int) -> dict[str, Any]:
    """The numbers on a runner with no rows (`step_tokens`: the step's token budget, --max-num-batched-tokens)."""
    from decoder_service.engine.spec.config import SpecConfig

    cfg = SpecConfig()
    return {"k": K, "steps": steps, "verify": {str(n): verify_vs_decode(runner, lm, n, steps) for n in BATCHES},
            "ngram_us": ngram_us(cfg.prompt_lookup_max, cfg.prompt_lookup_min, lm.config.get_text_config().vocab_size),
            "ngram": {"history": HISTORY, "n_max": cfg.prompt_lookup_max, "n_min": cfg.prompt_lookup_min},
            "chunked": chunked_prefill(runner, lm, steps, step_tokens - MIXED_ROWS)}


def add_rows(runner: ModelRunner, lm: LanguageHalf, rows: int, tag: str) -> dict[Hashable, int]:
    """`rows` rows of PROMPT_TOKENS random tokens, prefilled; each row's first token to feed."""
    import torch

    from decoder_service.prompt import Prompt

    vocab = lm.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(rows)
    for i in range(rows):
        runner.add((tag, i), Prompt(torch.randint(10, vocab - 10, (1, PROMPT_TOKENS), generator=gen), []))
    return {k: int(torch.argmax(v)) for k, v in runner.prefill(1 << 30).items()}


def remove_rows(runner: ModelRunner) -> None:
    for key in list(runner.rows):
        runner.remove(key)


def mean_step_s(step: Callable[[], object], steps: int, device: Any, before: Callable[[], object] | None = None
                ) -> float:
    """Mean seconds of `step`, each call timed alone between device syncs, after two warm-up calls; `before`
    (untimed) runs ahead of each."""
    total = 0.0
    for i in range(steps + 2):
        if before is not None:
            before()
        sync(device)
        started = time.perf_counter()
        step()
        sync(device)
        total += time.perf_counter() - started if i >= 2 else 0.0
    return total / steps


def decode_step(runner: ModelRunner, feed: dict[Hashable, int], budget: int = 0) -> None:
    """One engine step: every row fed its token (and prompt chunks within `budget`); greedy tokens fed next."""
    from decoder_service.engine.outputs import RowLogits, SchedulerOutput

    runner.grow(feed)
    logits = runner.run(SchedulerOutput(decode=feed, prefill_budget=budget)).logits
    assert isinstance(logits, RowLogits)
    keys = list(feed)
    feed.update(zip(keys, logits.rows_of(keys).argmax(-1).tolist(), strict=True))  # the engine's one batched read


def verify_step(runner: ModelRunner, feed: dict[Hashable, int], drafts: dict[Hashable, list[int]]) -> None:
    """Every row verifies its pending token and K drafts in one forward; then all K + 1 positions are dropped."""
    import torch

    from decoder_service.engine.outputs import SchedulerOutput

    for key in feed:
        runner.cover(key, runner.rows[key].length + K + 1)
    out = runner.run(SchedulerOutput(decode=feed, prefill_budget=0, drafts=drafts))
    assert len(out.verify) == len(feed), "every row verified"
    torch.cat([logits for logits, _ in out.verify.values()]).argmax(-1).tolist()  # the greedy check's read-back
    for key in feed:
        runner.rows[key].length -= K + 1


def verify_vs_decode(runner: ModelRunner, lm: LanguageHalf, rows: int, steps: int) -> dict[str, Any]:
    """Mean ms of a plain decode step (graphs where captured; and eager) and of a verification step, `rows` rows."""
    feed = add_rows(runner, lm, rows, f"spec{rows}")
    decode = mean_step_s(lambda: decode_step(runner, feed), steps, lm.device)
    graphs, runner.graphs = runner.graphs, None
    try:
        eager = mean_step_s(lambda: decode_step(runner, feed), steps, lm.device)
    finally:
        runner.graphs = graphs
    vocab = lm.config.get_text_config().vocab_size
    drafts = {key: [(token + 1 + j) % (vocab - 20) + 10 for j in range(K)] for key, token in feed.items()}
    verify = mean_step_s(lambda: verify_step(runner, feed, drafts), steps, lm.device)
    remove_rows(runner)
    return {"rows": rows, "decode_ms": _ms(decode), "decode_eager_ms": _ms(eager), "verify_ms": _ms(verify),
            "verify_over_decode": round(verify / decode, 3), "verify_over_eager": round(verify / eager, 3)}


def ngram_us(n_max: int, n_min: int, vocab: int) -> dict[str, float]:
    """Mean µs of one `propose` call (one row, one step) over random text and over a repeated passage."""
    import numpy as np

    from decoder_service.engine.spec.ngram import propose

    rng = np.random.default_rng(0)
    passage = rng.integers(10, vocab, 100, dtype=np.int64)
    histories = {"random": rng.integers(10, vocab, HISTORY, dtype=np.int64),
                 "repeated": np.tile(passage, HISTORY // len(passage))}
    out: dict[str, float] = {}
    for name, history in histories.items():
        started = time.perf_counter()
        for _ in range(NGRAM_CALLS):
            propose(history, K, n_max, n_min)
        out[name] = round((time.perf_counter() - started) / NGRAM_CALLS * 1e6, 2)
    return out


def chunked_prefill(runner: ModelRunner, lm: LanguageHalf, steps: int, chunk: int) -> dict[str, Any]:
    """Mean ms of a decode-only step of MIXED_ROWS rows and of one with a prompt chunk of `chunk` (a fresh prompt
    each step) or OLD_CHUNK tokens (one long prompt) beside them; each ÷ the decode-only step."""
    import torch

    from decoder_service.prompt import Prompt

    vocab = lm.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)
    feed = add_rows(runner, lm, MIXED_ROWS, "mixed")

    def arrive(num_tokens: int) -> None:  # a new prompt, the last one's blocks given back
        runner.remove("prompt")
        runner.add("prompt", Prompt(torch.randint(10, vocab - 10, (1, num_tokens), generator=gen), []))

    def whole() -> None:
        decode_step(runner, feed, chunk)
        assert runner.rows["prompt"].prefilled, "the prompt prefilled whole in one step"

    decode = mean_step_s(lambda: decode_step(runner, feed), steps, lm.device)
    new = mean_step_s(whole, steps, lm.device, lambda: arrive(chunk))
    arrive(OLD_CHUNK * (steps + 2) + 1)  # one prompt prefilled OLD_CHUNK tokens a step, never done here
    old = mean_step_s(lambda: decode_step(runner, feed, OLD_CHUNK), steps, lm.device)
    assert runner.rows["prompt"].length == OLD_CHUNK * (steps + 2), "OLD_CHUNK prompt tokens each step"
    remove_rows(runner)
    return {"rows": MIXED_ROWS, "decode_ms": _ms(decode), "new_chunk": chunk, "new_ms": _ms(new),
            "new_over_decode": round(new / decode, 3), "old_chunk": OLD_CHUNK, "old_ms": _ms(old),
            "old_over_decode": round(old / decode, 3)}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def report_lines(runs: dict[str, Any], h: str) -> list[str]:
    """The report's tables (epd_bench/gpu_check_report.py): family -> its `measure_spec` result; `h`: the heading."""
    return [*_verify_lines(runs, h), *_ngram_lines(runs), *_chunked_lines(runs, h)]


def _verify_lines(runs: dict[str, Any], h: str) -> list[str]:
    k, n = next(iter(runs.values()))["k"], next(iter(runs.values()))["steps"]
    draft = runs.get(DRAFT_FAMILY, {}).get("verify", {})  # rows -> the smallest model's plain step
    lines = ["", f"{h} Speculative decoding: a verification step (k = {k}) ÷ a plain decode step", "",
             f"Same runs as the engine table (`--spec`). Plain decode: one token per row, replaying the decode CUDA "
             f"graph as the engine does on CUDA (eager: without it). Verification: each row's pending token and {k} drafts as "
             f"one query of {k + 1} positions over its paged K/V, all rows in one forward (eager, as in the engine), "
             f"then the greedy check's read-back; every draft rejected. Mean of {n} steps, each timed between device "
             f"syncs. With n-gram drafts the speed-up is (1 + drafts accepted per verification) ÷ (verification ÷ "
             f"decode), so it breaks even at (verification ÷ decode) − 1 drafts accepted. Draft model (not run by this "
             f"engine, refused at start): a stand-in cost, {k} × one plain decode step of {DRAFT_FAMILY}'s LM at the "
             f"same rows (a real draft shares the target's vocabulary and is usually smaller, e.g. 0.5B).", "",
             "| model | rows | decode (ms) | decode eager (ms) | verification (ms) | verification ÷ decode "
             "| ÷ eager decode | break-even drafts, n-gram | draft model proposal (ms) | break-even, draft model |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for family, r in runs.items():
        for rows, v in r["verify"].items():
            cost = round(k * draft[rows]["decode_ms"], 3) if rows in draft else None
            even = "–" if cost is None else f"{(v['verify_ms'] + cost) / v['decode_ms'] - 1:.2f}"
            lines.append(f"| {family} | {rows} | {v['decode_ms']} | {v['decode_eager_ms']} | {v['verify_ms']} | "
                         f"{v['verify_over_decode']} | {v['verify_over_eager']} | {v['verify_over_decode'] - 1:.2f} | "
                         f"{'–' if cost is None else cost} | {even} |")
    return lines


def _ngram_lines(runs: dict[str, Any]) -> list[str]:
    lines = ["", "The n-gram proposer's host time per row per step (decoder_service/engine/spec/ngram.py `propose`, "
             f"k = {next(iter(runs.values()))['k']}): µs per call over random text (at these vocabularies the last token "
             "rarely recurs: no match) and over a repeated passage (the longest n-gram matches):", "",
             "| model | history (tokens) | n-gram lengths | random text (µs) | repeated passage (µs) |",
             "|---|---:|---|---:|---:|"]
    return lines + [f"| {f} | {r['ngram']['history']:,} | {r['ngram']['n_max']}..{r['ngram']['n_min']} | "
                    f"{r['ngram_us']['random']} | {r['ngram_us']['repeated']} |" for f, r in runs.items()]


def _chunked_lines(runs: dict[str, Any], h: str) -> list[str]:
    c0 = next(iter(runs.values()))["chunked"]
    lines = ["", f"{h} Chunked prefill: a decode step with a prompt chunk ÷ a decode-only step", "",
             f"{c0['rows']} decode rows; the step's prefill budget now defaults to the whole --max-num-batched-tokens "
             f"less its decode rows ({c0['new_chunk']:,} tokens: a fresh prompt prefilled whole each step), before "
             f"{c0['old_chunk']} tokens a step (of one long prompt): what a decoding stream's inter-token latency pays "
             "in a step where a prompt arrives. On CUDA decode-only steps replay the graph; a step with a chunk is eager.",
             "", "| model | decode rows | decode only (ms) | + new default's chunk (ms) | ÷ decode only "
             "| + old default's chunk (ms) | ÷ decode only |", "|---|---:|---:|---:|---:|---:|---:|"]
    for family, r in runs.items():
        c = r["chunked"]
        lines.append(f"| {family} | {c['rows']} | {c['decode_ms']} | {c['new_ms']} ({c['new_chunk']:,} tokens) | "
                     f"{c['new_over_decode']} | {c['old_ms']} ({c['old_chunk']} tokens) | {c['old_over_decode']} |")
    return lines
