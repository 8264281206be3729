"""An encoder serves the requests it holds in turn: another user's image is not queued behind every chunk of a
video request (encoder_service/fair_queue.py). Shown by the order the encode thread takes the calls in, never
by time: the first chunk holds the thread until all the calls are queued."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from connector.tensors.producer import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.fair_queue import FairExecutor
from encoder_service.server import EncoderState, create_app
from encoder_service.worker import EncoderWorker, ScheduledEncoderInput
from epd_common.http import REQUEST_ID_HEADER
from epd_common.logs import request_id_var
from epd_contracts.encode import EncodedItem
from epd_models.halves import VisionHalf
from tests.encoder_service.test_server import item, png
from tests.encoder_service.video_plan import plan_video
from tests.factories import make_video

VIDEO_CHUNKS = 4


class Recorder(EncoderWorker):
    """Records the request id of each call the encode thread runs; the first call waits for `release`."""

    def __init__(self, vision: VisionHalf) -> None:
        super().__init__(vision, ECProducer().start())
        self.order: list[str] = []
        self.started, self.release = threading.Event(), threading.Event()

    def execute_mm_encoder(self, scheduled_encoder_inputs: list[ScheduledEncoderInput]) -> list[EncodedItem]:
        self.order.append(request_id_var.get())
        self.started.set()
        assert self.release.wait(60), "the test never released the encode thread"
        return [EncodedItem(mm_hash=it.mm_hash, num_tokens=1) for it in scheduled_encoder_inputs]


@pytest.fixture
def encoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, Recorder]]:
    worker = Recorder(VisionHalf(tiny_model_dirs["qwen2_vl"]))
    with TestClient(create_app(EncoderConfig(insecure=True), worker)) as client:
        yield client, worker


def queued(client: TestClient) -> int:
    """Calls waiting for the encode thread (the old FIFO executor's queue too)."""
    state: EncoderState = client.app.state.encoder  # type: ignore[attr-defined]
    executor: Any = state.executor
    return executor.num_waiting if hasattr(executor, "num_waiting") else executor._work_queue.qsize()


def post(client: TestClient, body: dict[str, Any], request_id: str, answers: list[int]) -> threading.Thread:
    def send() -> None:
        answers.append(client.post("/encode", json=body, headers={REQUEST_ID_HEADER: request_id}).status_code)
    thread = threading.Thread(target=send)
    thread.start()
    return thread


def wait_for(condition: Any, what: str) -> None:
    done = threading.Event()
    for _ in range(6000):
        if condition():
            return
        done.wait(0.01)  # polling an event of the server's, not a fixed sleep before acting
    raise AssertionError(f"timed out waiting for {what}")


def test_an_image_is_encoded_before_the_rest_of_a_video_requests_chunks(encoder: tuple[TestClient, Recorder]) -> None:
    client, worker = encoder
    plan = plan_video(make_video(16, fps=10), {"sampler": "qwen2", "temporal_patch": 2, "min_pixels": 3136,
                                               "max_pixels": 1003520}, 2, num_frames=8)
    assert len(plan.chunks) == VIDEO_CHUNKS
    answers: list[int] = []
    threads = [post(client, {"items": [plan.item(c)]}, "video-request", answers) for c in plan.chunks[:1]]
    assert worker.started.wait(60)  # the first chunk holds the thread
    threads += [post(client, {"items": [plan.item(c)]}, "video-request", answers) for c in plan.chunks[1:]]
    wait_for(lambda: queued(client) == VIDEO_CHUNKS - 1, "the other chunks to queue")
    threads.append(post(client, {"items": [item(png("red"))]}, "image-request", answers))
    wait_for(lambda: queued(client) == VIDEO_CHUNKS, "the image to queue")
    worker.release.set()
    for t in threads:
        t.join(60)
    assert answers == [200] * (VIDEO_CHUNKS + 1)
    # the running chunk, at most one more of the video's, then the image: not after all of them (FIFO)
    assert worker.order.index("image-request") <= 2, worker.order
    assert worker.order.count("video-request") == VIDEO_CHUNKS


def test_the_thread_takes_each_request_in_turn_and_skips_calls_whose_caller_left() -> None:
    async def scenario() -> list[str]:
        executor, gate, order = FairExecutor(), threading.Event(), []

        def call(name: str) -> str:
            order.append(name)
            if name == "a0":
                assert gate.wait(60)
            return name

        first = asyncio.ensure_future(executor.run("a", lambda: call("a0")))
        while not order:  # the thread holds a0
            await asyncio.sleep(0.005)  # polling for the thread, not a fixed wait
        calls = {n: asyncio.ensure_future(executor.run(n[0], lambda n=n: call(n))) for n in ("a1", "a2", "b1", "c1", "b2")}
        while executor.num_waiting < 5:
            await asyncio.sleep(0.005)  # polling for the thread, not a fixed wait
        calls["b2"].cancel()  # its caller left: never run
        await asyncio.wait([calls["b2"]])  # its queued call is cancelled before the task ends
        gate.set()
        done = await asyncio.gather(first, *calls.values(), return_exceptions=True)
        assert isinstance(done[-1], asyncio.CancelledError)
        executor.shutdown()
        return order

    assert asyncio.run(scenario()) == ["a0", "a1", "b1", "c1", "a2"]
