"""An encoder serves the requests it holds in turn: another user's image is not queued behind every chunk of a
video request (encoder_service/encode_scheduler.py), though the chunks share forwards. Shown by the forwards the
encode thread runs, never by time: the first chunk holds the thread until all the calls are queued."""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from connector.tensors.producer import ECProducer
from encoder_service.config import EncoderConfig
from encoder_service.server import EncoderState, create_app
from encoder_service.worker import EncoderWorker
from epd_common.http import REQUEST_ID_HEADER
from epd_contracts.hashing import mm_hash
from epd_models.encode import Encoded, Job
from epd_models.halves import VisionHalf
from tests.encoder_service.test_server import item, png
from tests.encoder_service.video_plan import plan_video
from tests.factories import make_video

VIDEO_CHUNKS = 4


class Recorder(EncoderWorker):
    """Records which request each forward the encode thread runs is for (by its items' hashes, `owner`); the first
    forward waits for `release`."""

    def __init__(self, vision: VisionHalf) -> None:
        super().__init__(vision, ECProducer().start())
        self.forwards: list[list[str]] = []
        self.owner: dict[str, str] = {}  # mm_hash -> request id (the test fills it)
        self.started, self.release = threading.Event(), threading.Event()

    def run(self, jobs: Sequence[Job]) -> dict[str, Encoded]:
        self.forwards.append([self.owner[j.mm_hash] for j in jobs])
        self.started.set()
        assert self.release.wait(60), "the test never released the encode thread"
        return super().run(jobs)


@pytest.fixture
def encoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, Recorder]]:
    worker = Recorder(VisionHalf(tiny_model_dirs["qwen2_vl"]))
    # two items a forward: the video's chunks batch in pairs, so its rest is more than one forward
    with TestClient(create_app(EncoderConfig(insecure=True, max_encode_batch_items=2), worker)) as client:
        yield client, worker


def queued(client: TestClient) -> int:
    """Items waiting for the encode thread."""
    state: EncoderState = client.app.state.encoder  # type: ignore[attr-defined]
    assert state.scheduler is not None
    return state.scheduler.num_waiting


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
    worker.owner.update({plan.item(c)["mm_hash"]: "video-request" for c in plan.chunks})
    worker.owner[mm_hash(png("red"))] = "image-request"
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
    # the running chunk, one more forward of the video's (two chunks batched), then the image: not after all of them
    assert worker.forwards == [["video-request"], ["video-request"] * 2, ["image-request"], ["video-request"]]
