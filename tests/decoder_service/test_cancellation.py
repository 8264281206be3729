"""A client that disconnects mid-stream stops its sequence at the next step; the next request runs."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from decoder_service.state import DecoderState
from tests.decoder_service.engine_run import Result, collect, greedy, make_engine, text_prompt

TEXT = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}]


def wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_disconnect_mid_stream_aborts_the_sequence(decoder: tuple[str, DecoderState]) -> None:
    url, ref = decoder
    sampling = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    body = {"messages": TEXT, "sampling": sampling}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line))  # past keep-alive lines
        assert resp.status_code == 200 and first["type"] == "delta"
    engine = ref.engine
    assert wait_until(lambda: engine.scheduler.finished["abort"] == 1 and engine.num_running == 0)
    done = httpx.post(f"{url}/generate", json={**body, "sampling": {**sampling, "max_tokens": 3}}, timeout=30).text.splitlines()
    assert json.loads(done[-1])["finish_reason"] == "length" and engine.scheduler.finished["length"] == 1


def test_a_client_gone_during_prepare_never_enters_the_batch(decoder: tuple[str, DecoderState],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url, ref = decoder
    engine = ref.engine
    entered, release = threading.Event(), threading.Event()
    prepare, add = engine.prepare, engine.runner.add
    admitted: list[object] = []

    def slow_prepare(req: object) -> object:  # a gather that takes long (e.g. a pending image)
        entered.set()
        assert release.wait(30)
        return prepare(req)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "prepare", slow_prepare)
    monkeypatch.setattr(engine.runner, "add", lambda key, prompt: (admitted.append(key), add(key, prompt)))
    body = {"messages": TEXT, "sampling": {"max_tokens": 50, "ignore_eos": True, "temperature": 0}}
    client = threading.Thread(target=lambda: pytest.raises(httpx.ReadTimeout, httpx.post, f"{url}/generate",
                                                            json=body, timeout=httpx.Timeout(30, read=0.5)))
    client.start()
    assert entered.wait(30)
    client.join(timeout=30)  # the client gave up and closed its connection while prepare ran
    release.set()
    assert wait_until(lambda: engine.scheduler.finished["abort"] == 1)
    assert admitted == [] and engine.num_running == 0 and engine.num_waiting == 0


def test_a_cancelled_running_sequence_stops_within_one_step(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["llava"])

    async def main() -> tuple[int, int]:
        job = engine.submit(text_prompt(engine, 3), greedy(200))
        assert (await job.events.get()).type == "delta"
        job.cancelled.set()
        seen = len(job.token_times)  # chosen so far: at most the step in flight adds one more
        await asyncio.to_thread(wait_until, lambda: engine.scheduler.finished["abort"] == 1)
        return seen, len(job.token_times)

    try:
        seen, total = asyncio.run(main())
        assert total <= seen + 1 and engine.runner.rows == {} and engine.runner.num_free_blocks == engine.runner.blocks.num_usable and engine.num_running == 0
    finally:
        engine.close()


def test_a_job_cancelled_before_a_slot_takes_it_never_runs(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["llava"], max_num_seqs=1)

    async def main() -> Result:
        running = engine.submit(text_prompt(engine, 3), greedy(30))  # holds the only slot
        queued = engine.submit(text_prompt(engine, 4), greedy(30))
        queued.cancelled.set()
        result = await collect(running)
        await asyncio.to_thread(wait_until, lambda: engine.scheduler.finished["abort"] == 1)
        assert queued.events.empty() and queued.token_times == []
        return result

    try:
        assert asyncio.run(main()).ok and engine.scheduler.finished["length"] == 1 and engine.num_waiting == 0
    finally:
        engine.close()
