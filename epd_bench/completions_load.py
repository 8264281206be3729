"""A closed-loop load of token-id prompts on POST /v1/completions (any OpenAI-compatible server: EPD's proxy, vLLM).

Each prompt is a list of random token ids (no chat template, no tokenizer on the client), so two servers with the
same vocabulary get exactly the same prompt tokens. Requests stream (`stream_options.include_usage`), greedy,
`ignore_eos`, `max_tokens` fixed; at most `concurrency` are in flight, the next sent as one finishes. Timing as
epd-bench's (epd_bench/backends.py): TTFT to the first chunk with text, TPOT over the rest of the answer
(epd_bench.metrics.tpot), output tokens/s = the answers' completion tokens over the run's wall time.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from epd_bench.backends import RequestOutput
from epd_bench.metrics import tpot


def token_prompts(num: int, length: int, allowed: list[int], seed: int) -> list[list[int]]:
    """`num` prompts of `length` ids drawn uniformly from `allowed`, seeded; all different (ValueError if the
    draw repeats one, which random prompts of any useful length never do)."""
    rng = np.random.default_rng(seed)
    pool = np.asarray(allowed, dtype=np.int64)
    prompts = [pool[rng.integers(0, len(pool), size=length)].tolist() for _ in range(num)]
    if len({tuple(p) for p in prompts}) != num:
        raise ValueError("two prompts drew the same ids; use longer prompts or a larger vocabulary")
    return prompts


@dataclass(frozen=True)
class Target:
    url: str  # the server's base URL (POST {url}/v1/completions)
    model: str  # the `model` field it serves


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def complete(client: httpx.AsyncClient, target: Target, prompt: list[int], max_tokens: int) -> RequestOutput:
    """One streamed completion, timed; a non-200 answer, an error event or a transport error sets out.error."""
    out = RequestOutput()
    start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with client.stream("POST", f"{target.url}/v1/completions",
                                 json=completion_body(target.model, prompt, max_tokens)) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"])
                    return out
                text = "".join(c.get("text") or "" for c in obj.get("choices") or [])
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    out.generated_text += text
                usage = obj.get("usage") or usage
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    out.prompt_tokens = int((usage or {}).get("prompt_tokens", 0))
    out.output_tokens = int((usage or {}).get("completion_tokens", 0)) or chunks
    out.success = out.output_tokens > 0 and chunks > 0
    out.error = "" if out.success else "no output text"
    return out


async def run_closed_loop(target: Target, prompts: list[list[int]], concurrency: int, max_tokens: int,
                          timeout_s: float = 600.0) -> tuple[list[RequestOutput], float]:
    """Every prompt once, at most `concurrency` in flight; (outputs in prompt order, wall seconds)."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:

        async def one(prompt: list[int]) -> RequestOutput:
            async with limit:
                return await complete(client, target, prompt, max_tokens)

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        return list(outputs), time.perf_counter() - start


def summarize(outputs: list[RequestOutput], duration_s: float) -> dict[str, Any]:
    """One run's numbers: output tokens/s, mean TPOT and TTFT (ms) over the successful requests, each request's TTFT,
    and counts."""
    ok = [o for o in outputs if o.success]
    return {"completed": len(ok), "failed": len(outputs) - len(ok), "duration_s": duration_s,
            "output_tokens": sum(o.output_tokens for o in ok),
            "prompt_tokens": sum(o.prompt_tokens for o in ok),
            "output_tok_s": sum(o.output_tokens for o in ok) / duration_s if ok and duration_s > 0 else None,
            "mean_tpot_ms": statistics.fmean(tpot(o) for o in ok) * 1000.0 if ok else None,
            "mean_ttft_ms": statistics.fmean(o.ttft for o in ok) * 1000.0 if ok else None,
            # each request's, sorted: which arrivals shared a first step (a mean alone cannot tell that from compute)
            "ttfts_ms": sorted(round(o.ttft * 1000.0, 1) for o in ok),
            "errors": sorted({o.error for o in outputs if o.error})[:3]}


def measure(target: Target, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """run_closed_loop, summarized."""
    outputs, duration = asyncio.run(run_closed_loop(target, prompts, concurrency, max_tokens))
    return summarize(outputs, duration)


def greedy_text(target: Target, prompt: list[int], max_tokens: int) -> str:
    """The streamed text of one greedy answer (the two servers' answers are compared with it)."""
    outputs, _ = asyncio.run(run_closed_loop(target, [prompt], 1, max_tokens))
    return outputs[0].generated_text if outputs[0].success else f"<failed: {outputs[0].error}>"
