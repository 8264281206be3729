"""An encoder with a disk tier, killed with SIGKILL and restarted by the launcher on the same folder, serves a
repeat image from its files: the same answer, and no vision forward in the new process (its own metrics say so).
The decoder is killed too, so its own caches cannot answer for the encoder."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import Stack, ask_colour, demo_png, launched, metric, pid_alive, urls_of
from tests.e2e.test_supervision import BACK_WITHIN_S, poll, worker_pids

pytestmark = pytest.mark.e2e
IMAGE = demo_png("red", 4242)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ec-disk")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, disk_dir: Path) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("disk-restart"), "--model", "demo", "--num-encoders", "1",
                  "--num-decoders", "1", "--health-interval", "0.5", "--restart-backoff", "0.5",
                  "--ec-disk-dir", str(disk_dir), "--ec-disk-bytes", "64MiB") as s:
        yield s


def encoder_metric(stack: Stack, name: str) -> float:
    return metric(httpx.get(f"{urls_of(stack, 'encoders')[0]}/metrics", timeout=30).text, name)


def restarted(stack: Stack, old: dict[str, int]) -> bool:
    """Whether both workers answer /health from new processes (while they restart, nobody may answer at all)."""
    try:
        return all(pid != old[role] for role, pid in worker_pids(stack).items())
    except (httpx.HTTPError, AssertionError, KeyError, IndexError):
        return False


def answer(stack: Stack) -> str | None:
    try:
        resp = ask_colour(stack.base_url, IMAGE)
    except httpx.HTTPError:
        return None
    return str(resp.json()["choices"][0]["message"]["content"]) if resp.status_code == 200 else None


def test_a_repeat_after_kill_9_is_served_from_disk_without_a_vision_forward(stack: Stack, disk_dir: Path) -> None:
    first = answer(stack)
    assert first is not None and encoder_metric(stack, "epd_encoder_items_encoded_total") == 1
    poll("the embedding written to disk", lambda: encoder_metric(stack, "epd_ec_disk_writes") == 1, 60)
    files = list((disk_dir / "encoder-0").glob("*/*.emb"))
    assert len(files) == 1, files
    old = worker_pids(stack)
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    poll("both workers gone", lambda: not any(pid_alive(p) for p in old.values()), 30)
    poll("a new encoder and decoder", lambda: restarted(stack, old), BACK_WITHIN_S)
    again: list[str | None] = [None]

    def answered() -> bool:
        again[0] = answer(stack)
        return again[0] is not None

    poll("the repeat answered", answered, BACK_WITHIN_S)
    assert again[0] == first
    assert encoder_metric(stack, "epd_encoder_items_encoded_total") == 0  # the new process ran no vision forward
    assert encoder_metric(stack, "epd_ec_disk_hits") >= 1 and encoder_metric(stack, "epd_ec_disk_items") == 1
    assert stack.worker_pid(urls_of(stack, "encoders")[0]) != old["encoder"]
