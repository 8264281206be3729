"""A flood of /encode calls against one encoder: past --max-pending-encode-tokens each extra call is a 503
encoder_busy with Retry-After and an OpenAI-style body before anything of it queues; the calls admitted are served,
in batches across calls, with exactly the embeddings each image gets alone; once the queue drains the next call is
served as usual. The encode thread is held on a gate while the flood arrives (no timing)."""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
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
from tests.hostile.test_video_fairness import wait_for

FLOOD = 12


class Gated(EncoderWorker):
    """The first forward waits for `release`; each forward's hashes are recorded."""

    def __init__(self, vision: VisionHalf) -> None:
        super().__init__(vision, ECProducer().start())
        self.batches: list[list[str]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def run(self, jobs: Sequence[Job]) -> dict[str, Encoded]:
        self.batches.append([j.mm_hash for j in jobs])
        self.started.set()
        assert self.release.wait(60), "the test never released the encode thread"
        return super().run(jobs)


@pytest.fixture
def encoder(tiny_model_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, Gated]]:
    worker = Gated(VisionHalf(tiny_model_dirs["qwen2_vl"]))
    per_image = worker.vision.image_tokens((64, 64))
    cfg = EncoderConfig(insecure=True, max_pending_encode_tokens=4 * per_image)  # four images may wait
    with TestClient(create_app(cfg, worker)) as client:
        yield client, worker


def test_a_flood_past_the_bound_gets_503s_and_the_admitted_calls_are_served_exactly(
        encoder: tuple[TestClient, Gated], tiny_model_dirs: dict[str, Path]) -> None:
    client, worker = encoder
    state: EncoderState = client.app.state.encoder  # type: ignore[attr-defined]
    assert state.scheduler is not None
    answers: dict[str, Any] = {}

    def send(name: str, color: str) -> threading.Thread:
        def run() -> None:
            answers[name] = client.post("/encode", json={"items": [item(png(color))]},
                                        headers={REQUEST_ID_HEADER: name})
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    first = send("holder", "white")
    assert worker.started.wait(60)  # the thread holds the first call's forward
    colors = [f"#{i * 20:02x}{255 - i * 20:02x}80" for i in range(FLOOD)]
    flood = [send(f"flood{i}", c) for i, c in enumerate(colors)]
    try:
        wait_for(lambda: len(answers) + state.scheduler.num_waiting >= FLOOD,  # type: ignore[union-attr]
                 "the flood to be queued or refused")
        refused = {n: r for n, r in answers.items() if n.startswith("flood")}
        assert (len(refused), state.scheduler.num_waiting) == (FLOOD - 4, 4)
        for resp in refused.values():
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            err = resp.json()["error"]
            assert err["code"] == "encoder_busy" and err["type"] == "service_unavailable_error" and "waiting" in err["message"]
    finally:
        worker.release.set()
    for t in [first, *flood]:
        t.join(60)
    served = {n: r for n, r in answers.items() if r.status_code == 200}
    assert len(served) == 5  # the holder and the four admitted
    assert max(len(b) for b in worker.batches) == 4  # the four admitted calls shared one forward
    alone = VisionHalf(tiny_model_dirs["qwen2_vl"])
    for name in served:
        color = "white" if name == "holder" else colors[int(name.removeprefix("flood"))]
        got = worker.producer.get_cache_item(mm_hash(png(color)))
        assert got is not None and torch.equal(got.embeds, alone.encode([_image(color)])[0].embeds), name
    after = client.post("/encode", json={"items": [item(png("black"))]})
    assert after.status_code == 200 and state.scheduler.pending_tokens == 0
    metrics = client.get("/metrics").text
    assert f'epd_encoder_requests_total{{status="503"}} {float(FLOOD - 4)}' in metrics
    assert "epd_encoder_batch_items_bucket" in metrics and "epd_encoder_queue_wait_seconds_count" in metrics


def _image(color: str) -> Any:
    import io

    from PIL import Image
    return Image.open(io.BytesIO(png(color))).convert("RGB")
