"""Prefill saved by n > 1: one request with n = 4 against four requests with n = 1, through the real Engine.

    python -m epd_bench.n_prefill [--json] [--model bench] [--device auto] [--image-tokens 196] [--words 60]

The prompt is image-sized: one image's placeholder (its features random, of the LM's width: the bench
model's ViT-B/16 makes 196 tokens) plus some text, a few hundred tokens in all. Both sides use the same
prompt and the same seeds (choice i of the n = 4 request seeds like the i-th single request), so they
sample the same tokens; what differs is the prefill. Reported side by side: prompt tokens prefilled
(counted by the runner) and the time from submit until all 4 choices have their first token. Also the
two ways to give a second row the prompt's K/V: sharing its blocks and copying the last one (what n > 1
does) against prefilling the L tokens again.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any

from epd_bench.micro import decoder_engine, emit, parser, sync

if TYPE_CHECKING:  # the run imports them (torch and the engine), after --help has answered
    from decoder_service.engine.sequence import Job
    from decoder_service.prompt import Prompt
    from decoder_service.shell import Engine
    from epd_contracts.sampling import SamplingParams
    from epd_models.halves import LanguageHalf

N = 4


def image_prompt(lm: LanguageHalf, image_tokens: int, words: int) -> Prompt:
    import torch

    from decoder_service.prompt import build_prompt
    from epd_contracts.embeddings import ImageFeatures
    from epd_models.chat import chat_template, render

    text = " ".join(["what color is the shape in the picture"] * max(1, words // 8))
    ids = render(lm.tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                 chat_template(lm.tokenizer, lm.model_dir))
    hidden = int(lm.config.get_text_config().hidden_size)
    features = ImageFeatures(embeds=torch.randn(image_tokens, hidden, generator=torch.Generator().manual_seed(0)))
    return build_prompt(lm, ids, [features])


async def _first_tokens(engine: Engine, specs: list[tuple[Prompt, SamplingParams]]) -> tuple[float, int]:
    """(seconds from submit until every choice has its first token, prompt tokens prefilled) of jobs run together."""
    before = engine.runner.num_prefilled_tokens
    start = time.perf_counter()
    jobs: list[Job] = [engine.submit(prompt, params) for prompt, params in specs]
    for job in jobs:
        done = 0
        while done < job.params.n:
            event = await job.events.get()
            assert event.type != "error", event.message
            done += event.type == "done"
    # every choice chooses its first token in the step its prompt completes: the first n token times of a job
    first = max(t for job in jobs for t in job.token_times[: job.params.n])
    return first - start, engine.runner.num_prefilled_tokens - before


def compare(engine: Engine, prompt: Prompt, repeats: int) -> dict[str, Any]:
    from epd_contracts.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    shared = [(prompt, SamplingParams(**{**_fields(params), "n": N}))]
    separate = [(prompt, SamplingParams(**{**_fields(params), "seed": params.choice_seed(i)})) for i in range(N)]
    rows: dict[str, list[tuple[float, int]]] = {"n=4 (one request)": [], "4 x n=1": []}
    for _ in range(repeats):  # interleaved, so drift hits both alike
        rows["n=4 (one request)"].append(asyncio.run(_first_tokens(engine, shared)))
        rows["4 x n=1"].append(asyncio.run(_first_tokens(engine, separate)))
    return {name: {"prompt_tokens_prefilled": runs[0][1],
                   "first_token_of_all_4_ms": round(statistics.median(t for t, _ in runs) * 1e3, 2)}
            for name, runs in rows.items()}


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def copy_vs_recompute(lm: LanguageHalf, prompt: Prompt, repeats: int) -> dict[str, float]:
    """Milliseconds to give a second row the prompt's K/V: share its blocks (copying the last), or prefill it again."""
    from decoder_service.engine.model_runner import ModelRunner

    runner = ModelRunner(lm, max_slots=2, max_len=prompt.num_tokens + 8, chunk=prompt.num_tokens)
    device = runner.cache.device
    prefill, copy = [], []
    for _ in range(repeats):
        runner.add("a", prompt)
        sync(device)
        start = time.perf_counter()
        runner.prefill(prompt.num_tokens)
        sync(device)
        prefill.append(time.perf_counter() - start)
        start = time.perf_counter()
        blocks = runner.rows["a"].blocks  # a fork: references to the full blocks, a copy of the last one
        runner.blocks.acquire(blocks[:-1])
        spare = runner.blocks.allocate(1)
        runner.cache.copy_block(blocks[-1], spare[0])
        runner.blocks.release(blocks[:-1] + spare)
        sync(device)
        copy.append(time.perf_counter() - start)
        runner.remove("a")
    return {"prompt_tokens": prompt.num_tokens, "prefill_ms": round(statistics.median(prefill) * 1e3, 3),
            "copy_ms": round(statistics.median(copy) * 1e3, 3)}


def run(model: str = "bench", device: str = "auto", image_tokens: int = 196, words: int = 60,
        repeats: int = 5) -> dict[str, Any]:
    from decoder_service.config import DecoderConfig
    from epd_models.halves import LanguageHalf
    from epd_models.resolve import resolve_model

    lm = LanguageHalf(resolve_model(model), device=device)
    prompt = image_prompt(lm, image_tokens, words)
    cfg = DecoderConfig(max_num_seqs=8, max_prefill_tokens=512, max_model_len=prompt.num_tokens + 64)
    engine = decoder_engine(lm, cfg, cache_bytes=0)
    try:
        compare(engine, prompt, 1)  # warm-up
        out = {"model": model, "device": str(lm.device), "prompt_tokens": prompt.num_tokens,
               "n_prefill": compare(engine, prompt, repeats),
               "kv_to_a_second_slot": copy_vs_recompute(lm, prompt, repeats)}
    finally:
        engine.close()
        engine.consumer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = parser("n_prefill", __doc__)
    p.add_argument("--model", default="bench", help="model name or directory (epd_models.resolve)")
    p.add_argument("--device", default="auto")
    p.add_argument("--image-tokens", type=int, default=196, help="tokens of the prompt's one image")
    p.add_argument("--words", type=int, default=60, help="words of the prompt's text")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    emit(run(args.model, args.device, args.image_tokens, args.words, args.repeats), args.json, text, indent=2)


def text(out: dict[str, Any]) -> str:
    rows = [f"  {name:20s} prefilled {row['prompt_tokens_prefilled']:5d} tokens, all 4 first tokens after "
            f"{row['first_token_of_all_4_ms']:8.2f} ms" for name, row in out["n_prefill"].items()]
    kv = out["kv_to_a_second_slot"]
    return "\n".join([f"{out['model']} on {out['device']}, prompt {out['prompt_tokens']} tokens", *rows,
                      f"  K/V to a second slot: copy {kv['copy_ms']} ms vs prefill again {kv['prefill_ms']} ms"])


if __name__ == "__main__":
    main()
