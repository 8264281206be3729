"""200 concurrent streams against one decoder running at most 32 sequences: none lost, each as if alone
(greedy and seeded sampling alike)."""
from __future__ import annotations

import asyncio
import json

import httpx

from decoder_service.state import DecoderState

NUM_REQUESTS, NUM_PROMPTS = 200, 20


def body(i: int) -> dict:
    text = " ".join(["describe the image"] * (1 + i % NUM_PROMPTS))  # 20 prompts of different lengths
    sampling = {"temperature": 1.0, "seed": i % 5} if i % 5 == 0 else {"temperature": 0}  # some seeded sampling
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            "sampling": {"max_tokens": 4 + i % 7, "ignore_eos": True, **sampling}}


async def stream(client: httpx.AsyncClient, url: str, payload: dict) -> tuple[str, dict]:
    text, done = [], {}
    async with client.stream("POST", f"{url}/generate", json=payload) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line:  # a keep-alive line while the stream waits for a row
                continue
            event = json.loads(line)
            if event["type"] == "delta":
                text.append(event["text"])
            else:
                done = event
    return "".join(text), done


async def run_all(url: str) -> tuple[dict[int, tuple[str, dict]], list[tuple[str, dict]]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        alone = {i: await stream(client, url, body(i)) for i in range(NUM_PROMPTS * 7)}  # one at a time
        # NOTE: a TaskGroup, not gather: when one stream fails the others are cancelled and awaited, so every stream
        # leaves its `async with` and closes its connection before the client goes (gather left them running, and
        # their sockets unclosed for a later test's ResourceWarning)
        async with asyncio.TaskGroup() as group:
            together = [group.create_task(stream(client, url, body(i))) for i in range(NUM_REQUESTS)]
    return alone, [task.result() for task in together]


def test_200_concurrent_streams_all_complete_with_their_single_run_output(
        decoder: tuple[str, DecoderState]) -> None:
    url, ref = decoder
    alone, together = asyncio.run(run_all(url))
    engine = ref.engine
    # the cap bound (every slot used, never more) and nothing is left behind
    assert engine.scheduler.peak_running == 32 and engine.num_running == 0 and engine.num_waiting == 0
    for i, (text, done) in enumerate(together):
        expected_text, expected_done = alone[i % (NUM_PROMPTS * 7)]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        # cached_tokens differ by design: a prompt seen before reuses its cached prefix
        usage, expected_usage = ({k: v for k, v in u.items() if k != "cached_tokens"}
                                 for u in (done["usage"], expected_done["usage"]))
        assert (text, usage) == (expected_text, expected_usage), f"request {i} differs"
    assert engine.runner.prefix is not None and engine.runner.prefix.hits > 0  # the repeats did reuse K/V
