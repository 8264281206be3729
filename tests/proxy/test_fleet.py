"""Fleet encode fan-out against scripted encoders (httpx.MockTransport): split, in-flight dedupe, failover,
errors reaching every request that waits for an item, and work that outlives a client that left."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from connector.tensors.producer import ECProducer
from epd_common.errors import APIError
from epd_contracts.video import VideoPart, VideoSampling
from proxy.config import ProxyConfig
from proxy.fleet import Fleet
from proxy.metrics import ProxyMetrics
from proxy.workers import ModelMismatch
from scheduler.scheduler import MMItem
from tests.e2e.stack import metric
from tests.homes import one_each
from tests.waiting import HANG_S

Handler = Callable[[str, list[str]], Awaitable[httpx.Response]]  # (encoder url, hashes) -> reply


PRODUCERS: list[ECProducer] = []  # real producers stand in for the encoders' ZeroMQ side (snapshots, events)


@pytest.fixture(scope="module", autouse=True)
def producers() -> Iterator[None]:
    PRODUCERS.extend(ECProducer().start() for _ in range(2))
    yield
    for p in PRODUCERS:
        p.close()
    PRODUCERS.clear()


def address(url: str) -> str:
    return PRODUCERS[int(url.rsplit(":", 1)[1]) - 9100].address


def encoded(url: str, hashes: list[str]) -> httpx.Response:
    items = [{"mm_hash": h, "num_tokens": 4, "cached": False} for h in hashes]
    return httpx.Response(200, json={"items": items, "ec_address": address(url), "ec_epoch": "x", "ec_seq": 1})


class Encoders:
    """Scripted encoders: every /encode call is recorded, then answered by `handler`."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.calls: list[tuple[str, list[str], str | None]] = []
        self.in_flight = self.max_in_flight = 0
        self._called = asyncio.Event()  # set at each /encode call

    async def wait_calls(self, n: int = 1) -> None:
        """Until `n` /encode calls have arrived (the deadline only guards a hang)."""
        async with asyncio.timeout(HANG_S):
            while len(self.calls) < n:
                self._called.clear()
                await self._called.wait()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            producer = PRODUCERS[int(url.rsplit(":", 1)[1]) - 9100]
            return httpx.Response(200, json={"ec_address": producer.address, "ec_events_address": producer.events_address})
        hashes = [it["mm_hash"] for it in json.loads(request.content)["items"]]
        self.calls.append((url, hashes, request.headers.get("authorization")))
        self._called.set()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.handler(url, hashes)
        finally:
            self.in_flight -= 1


@asynccontextmanager
async def fleet_of(encoders: Encoders, n: int = 2) -> AsyncIterator[Fleet]:
    cfg = ProxyConfig(encode_urls=(), decode_urls=(), dynamic_registration=True, internal_key="inner")
    async with httpx.AsyncClient(transport=httpx.MockTransport(encoders)) as client:
        fleet = Fleet(cfg, client, ProxyMetrics(CollectorRegistry()))

        async def seen(_: dict[str, Any]) -> None:  # no real producer publishes events here
            return None

        fleet.calls._seen = seen  # type: ignore[method-assign]
        try:
            for i in range(n):
                await fleet.register("encoder", f"http://127.0.0.1:{9100 + i}")
            yield fleet
        finally:
            await fleet.close()


URLS = ("http://127.0.0.1:9100", "http://127.0.0.1:9101")
SPLIT = one_each(URLS)  # two items, one homed on each encoder (scheduler/rendezvous.py)


def items(*hashes: str) -> list[MMItem]:
    return [MMItem(h, h.encode()) for h in hashes]


async def ok(url: str, hashes: list[str]) -> httpx.Response:
    await asyncio.sleep(0)
    return encoded(url, hashes)


def held_until(release: asyncio.Event, reply: Callable[[str, list[str]], httpx.Response] = encoded) -> Handler:
    """Encoders that answer only once `release` is set (so a second request finds the encode in flight)."""
    async def handler(url: str, hashes: list[str]) -> httpx.Response:
        await release.wait()
        return reply(url, hashes)
    return handler


async def start_two(fleet: Fleet, encoders: Encoders, first: list[MMItem],
                    second: list[MMItem]) -> tuple[asyncio.Task[dict[str, str]], asyncio.Task[dict[str, str]]]:
    """Start a request, wait until its encode call is in flight, then start a second request."""
    one = asyncio.create_task(fleet.encode(first, "r1"))
    await encoders.wait_calls()
    two = asyncio.create_task(fleet.encode(second, "r2"))
    await asyncio.sleep(0)
    return one, two


def test_images_of_one_request_are_split_and_encoded_in_parallel_several_per_call() -> None:
    encoders = Encoders(ok)

    async def main() -> dict[str, str]:
        async with fleet_of(encoders) as fleet:
            return await fleet.encode(items("a", "b", "c", "d"), "rid")

    sources = asyncio.run(main())
    assert sorted(len(h) for _, h, _ in encoders.calls) == [2, 2] and encoders.max_in_flight == 2
    assert set(sources.values()) == {address("http://127.0.0.1:9100"), address("http://127.0.0.1:9101")}
    assert {auth for _, _, auth in encoders.calls} == {"Bearer inner"}  # the internal key goes to workers


def test_identical_images_in_concurrent_requests_are_encoded_once() -> None:
    release = asyncio.Event()
    encoders = Encoders(held_until(release))

    async def main() -> list[dict[str, str]]:
        async with fleet_of(encoders) as fleet:
            first, second = await start_two(fleet, encoders, items("same"), items("same", "same"))
            release.set()
            out = await asyncio.gather(first, second)
            assert metric(_scrape(fleet), "epd_proxy_items_joined_in_flight_total") == 1
            return out

    first, second = asyncio.run(main())
    assert [h for _, h, _ in encoders.calls] == [["same"]] and first == second


def test_an_encoder_that_fails_mid_request_is_marked_down_and_its_items_go_to_another() -> None:
    async def first_dies(url: str, hashes: list[str]) -> httpx.Response:
        if url.endswith("9100"):
            raise httpx.RemoteProtocolError("server disconnected")
        return encoded(url, hashes)

    encoders = Encoders(first_dies)

    async def main() -> tuple[dict[str, str], bool, float]:
        async with fleet_of(encoders) as fleet:
            sources = await fleet.encode(items("a", "b", "c"), "rid")
            return sources, fleet.workers.by_url["http://127.0.0.1:9100"].healthy, metric(
                _scrape(fleet), "epd_proxy_failovers_total")

    sources, first_healthy, failovers = asyncio.run(main())
    assert set(sources.values()) == {address("http://127.0.0.1:9101")} and sorted(sources) == ["a", "b", "c"]
    assert not first_healthy and failovers == 1


def test_a_connection_torn_down_inside_the_transport_is_the_encoders_failure_not_a_500() -> None:
    """anyio raised AttributeError (getpeername on a closed socket) from inside httpx when an encoder was killed
    mid-call; its items go to another encoder as for any transport error."""
    async def first_torn(url: str, hashes: list[str]) -> httpx.Response:
        if url.endswith("9100"):
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return encoded(url, hashes)

    async def main() -> tuple[dict[str, str], bool]:
        async with fleet_of(Encoders(first_torn)) as fleet:
            sources = await fleet.encode(items(*SPLIT), "rid")
            return sources, fleet.workers.by_url["http://127.0.0.1:9100"].healthy

    sources, first_healthy = asyncio.run(main())
    assert set(sources.values()) == {address("http://127.0.0.1:9101")} and not first_healthy
    assert sorted(sources) == sorted(SPLIT)


def test_no_encoder_left_is_a_503() -> None:
    async def down(url: str, hashes: list[str]) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async def main() -> None:
        async with fleet_of(Encoders(down)) as fleet:
            await fleet.encode(items("a"), "rid")

    with pytest.raises(APIError) as err:
        asyncio.run(main())
    assert err.value.status == 503 and err.value.code == "encoder_unavailable"


def test_a_bad_image_error_reaches_every_request_waiting_for_it() -> None:
    release = asyncio.Event()
    refusal = {"error": {"message": "cannot identify image", "code": "invalid_image"}}
    encoders = Encoders(held_until(release, lambda url, hashes: httpx.Response(400, json=refusal)))

    async def main() -> list[BaseException | dict[str, str]]:
        async with fleet_of(encoders) as fleet:
            first, second = await start_two(fleet, encoders, items("bad"), items("bad"))
            release.set()
            return await asyncio.gather(first, second, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, APIError) and r.status == 400 and r.code == "invalid_image" for r in results)
    assert len(encoders.calls) == 1  # a 4xx is the request's fault: not retried elsewhere


def test_a_client_that_leaves_does_not_cancel_an_encode_another_request_joined() -> None:
    release = asyncio.Event()
    encoders = Encoders(held_until(release))

    async def main() -> dict[str, str]:
        async with fleet_of(encoders) as fleet:
            leaver, stayer = await start_two(fleet, encoders, items("x"), items("x"))
            leaver.cancel()
            release.set()
            return await stayer

    assert list(asyncio.run(main())) == ["x"] and len(encoders.calls) == 1


def _scrape(fleet: Fleet) -> str:
    from prometheus_client import generate_latest

    return generate_latest(fleet.metrics.registry).decode()


def test_an_encoder_that_hangs_is_abandoned_when_probes_mark_it_down() -> None:
    async def first_hangs(url: str, hashes: list[str]) -> httpx.Response:
        if url.endswith("9100"):
            await asyncio.Event().wait()  # a link that drops packets: no error, no answer
        return encoded(url, hashes)

    encoders = Encoders(first_hangs)

    async def main() -> dict[str, str]:
        async with fleet_of(encoders) as fleet:
            task = asyncio.create_task(fleet.encode(items(*SPLIT), "rid"))
            await encoders.wait_calls(2)
            fleet.workers.mark_down(fleet.workers.by_url["http://127.0.0.1:9100"], "3 failed probe(s)")
            return await task

    sources = asyncio.run(main())
    assert set(sources.values()) == {address("http://127.0.0.1:9101")} and sorted(sources) == sorted(SPLIT)


POISON = {"error": {"message": "cannot encode this image", "type": "server_error", "code": "encode_failed"}}


async def poison_fails(url: str, hashes: list[str]) -> httpx.Response:
    """Every encoder answers 500 for the poison item (and encodes anything else)."""
    await asyncio.sleep(0)
    return httpx.Response(500, json=POISON) if "poison" in hashes else encoded(url, hashes)


@pytest.mark.parametrize("n", [1, 2])
def test_a_poison_item_fails_its_own_request_after_one_retry_and_marks_no_encoder_down(n: int) -> None:
    encoders = Encoders(poison_fails)

    async def main() -> tuple[APIError, list[bool], dict[str, str]]:
        async with fleet_of(encoders, n) as fleet:
            errors = []
            for _ in range(3):  # the same hostile request, again and again
                with pytest.raises(APIError) as err:
                    await fleet.encode(items("poison"), "rid")
                errors.append(err.value)
            healthy = [w.healthy for w in fleet.workers.of("encoder")]
            return errors[-1], healthy, await fleet.encode(items("fine"), "rid2")

    err, healthy, sources = asyncio.run(main())
    assert (err.status, err.code) == (500, "encode_failed") and err.message == POISON["error"]["message"]
    assert healthy == [True] * n and list(sources) == ["fine"]
    assert len([c for c in encoders.calls if c[1] == ["poison"]]) == 3 * n  # asked once, retried once elsewhere


def test_a_5xx_answer_is_retried_on_another_encoder_without_marking_the_first_down() -> None:
    async def first_overloaded(url: str, hashes: list[str]) -> httpx.Response:
        await asyncio.sleep(0)
        if url.endswith("9100"):
            return httpx.Response(503, json={"error": {"message": "busy", "code": "overloaded"}})
        return encoded(url, hashes)

    async def main() -> tuple[dict[str, str], bool]:
        async with fleet_of(Encoders(first_overloaded)) as fleet:
            sources = await fleet.encode(items("a", "b"), "rid")
            return sources, fleet.workers.by_url["http://127.0.0.1:9100"].healthy

    sources, first_healthy = asyncio.run(main())
    assert set(sources.values()) == {address("http://127.0.0.1:9101")} and first_healthy


def test_an_encoder_whose_health_names_no_zeromq_address_is_not_taken() -> None:
    async def main() -> tuple[bool, str]:
        cfg = ProxyConfig(encode_urls=(), decode_urls=(), dynamic_registration=True, internal_key="k")
        transport = httpx.MockTransport(lambda req: httpx.Response(200, json={"status": "ok"}))
        async with httpx.AsyncClient(transport=transport) as client:
            fleet = Fleet(cfg, client, ProxyMetrics(CollectorRegistry()))
            try:
                worker = await fleet.register("encoder", "http://127.0.0.1:9100")
                return worker.healthy, worker.reason
            finally:
                await fleet.close()

    healthy, reason = asyncio.run(main())
    assert not healthy and "ec_address" in reason


def test_registering_a_worker_of_another_model_is_refused_and_forgotten() -> None:
    fingerprints = {"9100": "f00d", "9101": "beef"}

    def health(req: httpx.Request) -> httpx.Response:
        producer = PRODUCERS[int(str(req.url.port)) - 9100]
        ident = {"family": "llava", "fingerprint": fingerprints[str(req.url.port)], "hidden_size": 64}
        return httpx.Response(200, json={"ec_address": producer.address, "ec_events_address": producer.events_address,
                                         "model_identity": ident})

    async def main() -> list[str]:
        cfg = ProxyConfig(encode_urls=(), decode_urls=(), dynamic_registration=True, internal_key="k")
        async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
            fleet = Fleet(cfg, client, ProxyMetrics(CollectorRegistry()))
            try:
                assert (await fleet.register("encoder", "http://127.0.0.1:9100")).healthy
                with pytest.raises(ModelMismatch, match="beef"):
                    await fleet.register("encoder", "http://127.0.0.1:9101")
                return list(fleet.workers.by_url)
            finally:
                await fleet.close()

    assert asyncio.run(main()) == ["http://127.0.0.1:9100"]


@pytest.mark.parametrize("body", [b"not json", b'{"items": "nope"}', b'{"ec_address": 5}'])
def test_an_unreadable_200_is_retried_once_then_every_waiting_request_gets_a_502(body: bytes) -> None:
    async def garbage(url: str, hashes: list[str]) -> httpx.Response:
        return httpx.Response(200, content=body)

    encoders = Encoders(garbage)

    async def main() -> tuple[list[BaseException | dict[str, str]], list[bool]]:
        async with fleet_of(encoders) as fleet:
            first, second = await start_two(fleet, encoders, items("a"), items("a"))
            # a guard, not a wait: before the fix the futures were never settled and both requests hung
            results = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 10)
            return results, [w.healthy for w in fleet.workers.of("encoder")]

    results, healthy = asyncio.run(main())
    assert all(isinstance(r, APIError) and r.status == 502 and r.code == "upstream_error" for r in results), results
    assert len(encoders.calls) == 2 and all(healthy)  # retried once elsewhere; it answered, so nobody is marked down


def chunks(*hashes: str) -> list[MMItem]:
    """Video chunks: one file, frames [2i, 2i + 2) each."""
    sampling = VideoSampling(num_frames=2 * len(hashes), fps=2.0, max_pixels=1 << 16)
    return [MMItem(h, b"video", video=VideoPart(sampling=sampling, first=2 * i, count=2, total=2 * len(hashes)))
            for i, h in enumerate(hashes)]


def test_video_chunks_go_one_per_call_and_fail_over_chunk_by_chunk() -> None:
    async def first_dies(url: str, hashes: list[str]) -> httpx.Response:
        if url.endswith("9100"):
            raise httpx.RemoteProtocolError("server disconnected")
        return encoded(url, hashes)

    encoders = Encoders(first_dies)

    async def main() -> dict[str, str]:
        async with fleet_of(encoders) as fleet:
            return await fleet.encode([*items("img1", "img2"), *chunks("c0", "c1", "c2")], "rid")

    sources = asyncio.run(main())
    assert set(sources.values()) == {address("http://127.0.0.1:9101")} and len(sources) == 5
    calls = [hashes for _, hashes, _ in encoders.calls]
    assert all(len(h) == 1 for h in calls if h[0].startswith("c"))  # each chunk alone, also after failover
    assert all(x.startswith("img") for h in calls if h[0].startswith("img") for x in h)  # images apart from chunks
    done = [h for url, h, _ in encoders.calls if url.endswith("9101")]
    assert sorted(x for h in done for x in h) == ["c0", "c1", "c2", "img1", "img2"]



def test_the_fleet_gauges_read_healthy_workers_and_outstanding_items_at_scrape_time() -> None:
    release = asyncio.Event()
    encoders = Encoders(held_until(release))

    async def main() -> tuple[str, str]:
        async with fleet_of(encoders) as fleet:
            text = generate_latest(fleet.metrics.registry).decode()
            task = asyncio.create_task(fleet.encode(items("a", "b"), "rid"))
            await encoders.wait_calls()
            busy = generate_latest(fleet.metrics.registry).decode()
            release.set()
            await task
            return text, busy

    idle, busy = asyncio.run(main())
    assert 'epd_proxy_workers_healthy{role="encoder"} 2.0' in idle
    assert 'epd_proxy_workers_healthy{role="decoder"} 0.0' in idle
    assert "epd_proxy_encoder_items_outstanding 0.0" in idle
    assert "epd_proxy_encoder_items_outstanding 2.0" in busy
