"""Worker health: N failed probes in a row take a worker out, one good probe brings it back; decoders are
chosen by load among the healthy ones."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from epd_common.errors import APIError
from proxy.worker_state import Worker, WorkerDown, until_down
from proxy.workers import ModelMismatch, Workers
from tests.waiting import HANG_S


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
        w.set_down()
        with pytest.raises(WorkerDown):
            await call
        assert not w.calls
        with pytest.raises(WorkerDown):  # refused at once while down
            await until_down(asyncio.sleep(0), w)
        assert await until_down(asyncio.sleep(0, result=7), Worker("encoder", "http://f", healthy=True)) == 7

    asyncio.run(main())


def test_a_call_whose_caller_is_cancelled_is_cancelled_not_turned_into_worker_down() -> None:
    async def main() -> None:
        w = Worker("encoder", "http://e", healthy=True)
        started, inner_cancelled = asyncio.Event(), asyncio.Event()

        async def slow() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                inner_cancelled.set()
                raise

        call = asyncio.create_task(until_down(slow(), w))
        await started.wait()
        w.set_down()
        call.cancel()  # both at once: the caller's cancellation wins
        with pytest.raises(asyncio.CancelledError):
            await call
        assert inner_cancelled.is_set() and not w.calls

    asyncio.run(main())


def identity(fingerprint: str, family: str = "llava") -> dict[str, object]:
    return {"family": family, "fingerprint": fingerprint, "hidden_size": 64}


def health_of(bodies: dict[str, dict[str, object]]) -> httpx.MockTransport:
    """Workers whose /health answers the given body (by host)."""
    return httpx.MockTransport(lambda req: httpx.Response(200, json=bodies[req.url.host]))


def test_a_worker_of_another_model_is_never_taken_into_service(caplog: pytest.LogCaptureFixture) -> None:
    bodies = {"a": {"model_identity": identity("f00d")}, "b": {"model_identity": identity("beef", "qwen2_5_vl")},
              "c": {"status": "ok"}}

    async def main() -> tuple[list[bool], list[str]]:
        async with httpx.AsyncClient(transport=health_of(bodies)) as client:
            workers = Workers(client, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)
            a, b, c = workers.add("decoder", "http://a"), workers.add("encoder", "http://b"), workers.add("encoder", "http://c")
            ups = [await workers.probe(a), await workers.probe(b), await workers.probe(b), await workers.probe(c)]
            return ups, [a.reason, b.reason] if not b.healthy else []

    ups, reasons = asyncio.run(main())
    assert ups == [True, False, False, True]  # c reports no identity: unknown, taken (with a warning)
    assert reasons[1].startswith("model_mismatch") and "beef" in reasons[1] and "f00d" in reasons[1]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and all(s in errors[0] for s in ("beef", "f00d", "llava", "qwen2_5_vl", "http://b"))
    assert any("no model_identity" in r.getMessage() and "http://c" in r.getMessage() for r in caplog.records)


def test_a_healthy_worker_restarted_with_another_model_is_taken_out() -> None:
    bodies = {"a": {"model_identity": identity("f00d")}, "b": {"model_identity": identity("f00d")}}
    downs: list[str] = []

    async def main() -> bool:
        async with httpx.AsyncClient(transport=health_of(bodies)) as client:
            workers = Workers(client, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: downs.append(w.url))
            a, b = workers.add("decoder", "http://a"), workers.add("decoder", "http://b")
            assert await workers.probe(a) and await workers.probe(b)
            bodies["b"] = {"model_identity": identity("cafe")}
            return await workers.probe(b)

    assert not asyncio.run(main()) and downs == ["http://b"]


def test_readiness_names_the_missing_role() -> None:
    workers = Workers(None, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)  # type: ignore[arg-type]
    assert "no healthy decoder (none registered)" in str(workers.not_ready(need_encoder=True))
    d = workers.add("decoder", "http://d")
    d.reason = "1 failed probe(s): refused"
    assert "http://d: 1 failed probe(s): refused" in str(workers.not_ready(need_encoder=False))
    d.healthy = True
    assert workers.not_ready(need_encoder=False) is None
    assert "no healthy encoder" in str(workers.not_ready(need_encoder=True))
    workers.add("encoder", "http://e").healthy = True
    assert workers.not_ready(need_encoder=True) is None


def test_a_healthy_prefill_worker_alone_is_ready_it_runs_requests_whole() -> None:
    workers = Workers(None, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)  # type: ignore[arg-type]
    workers.add("decoder", "http://d").reason = "killed"
    p = workers.add("prefill", "http://p")
    p.reason = "starting"
    assert "http://d: killed; http://p: starting" in str(workers.not_ready(need_encoder=False))
    p.healthy = True
    assert workers.not_ready(need_encoder=False) is None


def test_waiting_for_workers_logs_each_unreachable_one_with_url_and_reason_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    probes = {"dns": 0, "slow": 0, "refused": 0}  # host -> probes so far
    probed_thrice = asyncio.Event()

    def unreachable(request: httpx.Request) -> httpx.Response:
        probes[request.url.host] += 1
        if min(probes.values()) == 3:
            probed_thrice.set()
        if request.url.host == "dns":
            raise httpx.ConnectError("[Errno -2] Name or service not known")
        if request.url.host == "slow":
            raise httpx.ConnectTimeout("timed out")
        raise httpx.ConnectError("[Errno 111] Connection refused")

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(unreachable)) as client:
            workers = Workers(client, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)
            urls = ["http://dns:1", "http://slow:2", "http://refused:3"]
            for u in urls:
                workers.add("decoder", u)
            waiting = asyncio.create_task(workers.wait_healthy(urls, time.monotonic() + HANG_S))
            async with asyncio.timeout(HANG_S):  # three probes each, counted; the deadline only guards a hang
                await probed_thrice.wait()
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await workers.wait_healthy(urls, time.monotonic())  # past its deadline: fails after one probe each

    with pytest.raises(RuntimeError, match="not healthy"):
        asyncio.run(main())
    assert min(probes.values()) >= 4
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert len(waits) == 3  # one line per worker (then at most one per 10 s), not one per probe
    assert any("http://dns:1" in m and "DNS" in m for m in waits)
    assert any("http://slow:2" in m and "timeout" in m for m in waits)
    assert any("http://refused:3" in m and "refused" in m for m in waits)


def test_a_worker_of_another_model_fails_a_static_start_at_once() -> None:
    bodies = {"a": {"model_identity": identity("f00d")}, "b": {"model_identity": identity("beef")}}

    async def main() -> None:
        async with httpx.AsyncClient(transport=health_of(bodies)) as client:
            workers = Workers(client, 1.0, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)
            a = workers.add("decoder", "http://a")
            await workers.probe(a)
            workers.add("encoder", "http://b")
            await workers.wait_healthy(["http://b"], time.monotonic() + 60)

    with pytest.raises(ModelMismatch, match="beef"):
        asyncio.run(main())


def test_one_odd_worker_does_not_stop_the_probes_of_the_others() -> None:
    async def main() -> tuple[bool, bool]:
        workers = Workers(None, 0.01, 1.0, 3, on_up=lambda w: None, on_down=lambda w: None)  # type: ignore[arg-type]
        odd, fine = workers.add("encoder", "http://odd"), workers.add("decoder", "http://fine")
        odd.healthy = True
        probed: list[str] = []
        fine_thrice = asyncio.Event()

        async def probe(w: Worker) -> bool:
            probed.append(w.url)
            if probed.count("http://fine") == 3:
                fine_thrice.set()
            if w is odd:
                raise KeyError("ec_address")
            return True

        workers.probe = probe  # type: ignore[method-assign]
        workers.start()
        async with asyncio.timeout(HANG_S):  # the third probe of the fine worker; the deadline only guards a hang
            await fine_thrice.wait()
        await workers.stop()
        return odd.healthy, fine.url in probed

    assert asyncio.run(main()) == (False, True)
