"""Worker health: N failed probes in a row take a worker out, one good probe brings it back; decoders are
chosen by load among the healthy ones."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from common.errors import APIError
from proxy.workers import Worker, WorkerDown, Workers, until_down


class Probed:
    """A worker whose /health answers 200 while `up` is True, and fails to connect otherwise."""

    def __init__(self) -> None:
        self.up = True
        self.probes = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.probes += 1
        if not self.up:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"status": "ok"})


def run_probes(script: list[bool], failures_to_down: int = 3) -> list[bool]:
    """Probe once per entry (True: the worker answers); returns whether it was healthy after each probe."""
    worker = Probed()
    events: list[str] = []

    async def main() -> list[bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(worker)) as client:
            workers = Workers(client, 1.0, 1.0, failures_to_down, on_up=lambda w: events.append("up"),
                              on_down=lambda w: events.append("down"))
            w = workers.add("decoder", "http://d0")
            seen = []
            for up in script:
                worker.up = up
                await workers.probe(w)
                seen.append(w.healthy)
            return seen

    return asyncio.run(main())


def test_a_worker_is_taken_out_after_n_failed_probes_in_a_row_and_back_after_one_good_one() -> None:
    assert run_probes([True, False, False, True, False, False, False, True]) == \
        [True, True, True, True, True, True, False, True]


def test_never_healthy_worker_gets_no_work() -> None:
    assert run_probes([False, False, True]) == [False, False, True]


def test_decoders_are_chosen_by_load_among_healthy_ones() -> None:
    workers = Workers(None, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)  # type: ignore[arg-type]
    a, b, c = (workers.add("decoder", u) for u in ("http://a", "http://b", "http://c"))
    a.healthy = b.healthy = True  # c never answered
    picks = [workers.acquire_decoder(set()).url for _ in range(4)]
    assert sorted(picks) == ["http://a", "http://a", "http://b", "http://b"]
    assert workers.acquire_decoder({"http://a"}).url == "http://b"
    with pytest.raises(APIError) as err:
        workers.acquire_decoder({"http://a", "http://b"})
    assert err.value.status == 503


def test_registration_is_idempotent_and_a_url_keeps_its_role() -> None:
    workers = Workers(None, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)  # type: ignore[arg-type]
    assert workers.add("encoder", "http://e") is workers.add("encoder", "http://e")
    with pytest.raises(ValueError):
        workers.add("decoder", "http://e")
    assert workers.remove("http://e") is not None and workers.remove("http://e") is None


def test_a_call_in_flight_gives_up_when_its_worker_is_marked_down() -> None:
    async def main() -> None:
        w = Worker("encoder", "http://e", healthy=True)
        call = asyncio.create_task(until_down(asyncio.Event().wait(), w))
        await asyncio.sleep(0)
        w.down.set()
        with pytest.raises(WorkerDown):
            await call
        assert await until_down(asyncio.sleep(0, result=7), Worker("encoder", "http://f", healthy=True)) == 7

    asyncio.run(main())
