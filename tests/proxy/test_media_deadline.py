"""A request's images load within its deadline (the download is aborted, not left reading), and a cap shared
by all requests bounds the downloads at once, on threads of their own, so slow hosts starve no one else."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from epd_common.errors import APIError
from proxy.fetch_slots import FetchSlots
from proxy.prepare import prepare_chat
from tests.proxy.media_helpers import (
    PARAM,
    PNG,
    ThreadingCountingServer,
    Trickle,
    as_data_url,
    config,
    request,
    running,
    serve,
    wait_for,
)

ALLOW_LOOPBACK = {"allowed_media_domains": ("127.0.0.1",)}


@pytest.fixture
def slow_host() -> Iterator[tuple[ThreadingCountingServer, Trickle]]:
    trickle = Trickle()
    with running(ThreadingCountingServer()) as srv:
        srv.routes["/slow.png"] = trickle
        srv.routes["/fast.png"] = serve(PNG)
        yield srv, trickle
        trickle.release.set()


def test_the_request_deadline_aborts_a_trickling_download(slow_host: tuple[ThreadingCountingServer, Trickle]) -> None:
    srv, trickle = slow_host
    cfg = config(media_fetch_timeout=5.0, **ALLOW_LOOPBACK)  # each read is quick; only the deadline can stop it
    with pytest.raises(APIError) as err:
        prepare_chat(request(srv.url("/slow.png")), cfg, deadline=time.monotonic() + 0.5)
    assert err.value.status == 408 and err.value.code == "image_fetch_timeout" and err.value.param == PARAM
    assert wait_for(lambda: trickle.abandoned == 1 and trickle.active == 0)  # the proxy hung up: nothing reads on


def test_the_deadline_covers_all_images_of_a_request(slow_host: tuple[ThreadingCountingServer, Trickle]) -> None:
    srv, _ = slow_host
    cfg = config(media_fetch_timeout=5.0, **ALLOW_LOOPBACK)
    with pytest.raises(APIError) as err:  # the fast image loads, the slow one (the second) runs out of time
        prepare_chat(request(srv.url("/fast.png"), srv.url("/slow.png")), cfg, deadline=time.monotonic() + 0.5)
    assert err.value.status == 408 and err.value.param == PARAM.replace("content.0", "content.1")


def test_a_trickling_video_download_is_a_408_video_fetch_timeout() -> None:
    from epd_common.video_sampling import VideoConfig
    from tests.proxy.test_video_request import part
    from tests.proxy.test_video_request import request as video_request

    trickle = Trickle(content_type="video/mp4")
    with running(ThreadingCountingServer()) as srv:
        srv.routes["/slow.mp4"] = trickle
        video = VideoConfig(sampler="qwen2", temporal_patch=2, min_pixels=1, max_pixels=1 << 20)
        with pytest.raises(APIError) as err:
            prepare_chat(video_request(part(srv.url("/slow.mp4"))), config(media_fetch_timeout=5.0, **ALLOW_LOOPBACK),
                         deadline=time.monotonic() + 0.5, video=video)
        assert wait_for(lambda: trickle.abandoned == 1 and trickle.active == 0)
    assert (err.value.status, err.value.code) == (408, "video_fetch_timeout")
    assert err.value.param == "messages.0.content.0.video_url.url" and "still fetching video" in err.value.message


def test_a_silent_host_times_out_at_the_request_deadline() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepted by the kernel, never answered
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/x.png"
        with pytest.raises(APIError) as err:
            prepare_chat(request(url), config(media_fetch_timeout=5.0, **ALLOW_LOOPBACK),
                         deadline=time.monotonic() + 0.3)
    assert err.value.status == 408 and err.value.code == "image_fetch_timeout"


def test_a_request_that_gets_no_fetch_slot_before_its_deadline_gets_503() -> None:
    release, running_now = threading.Event(), [0]

    def download() -> bool:
        running_now[0] += 1
        return release.wait(30)

    async def scenario() -> APIError:
        slots = FetchSlots(2)
        far = time.monotonic() + 30
        hung = [asyncio.ensure_future(slots.run(far, download)) for _ in range(2)]
        assert await asyncio.to_thread(wait_for, lambda: running_now[0] == 2)
        with pytest.raises(APIError) as err:
            await slots.run(time.monotonic() + 0.2, lambda: "never runs")
        release.set()
        assert await asyncio.gather(*hung) == [True, True]
        assert await slots.run(time.monotonic() + 5, lambda: "runs now") == "runs now"
        slots.close()
        return err.value

    err = asyncio.run(scenario())
    assert err.status == 503 and err.code == "media_fetch_busy"


def test_a_slot_is_held_until_its_thread_ends_even_if_the_request_left() -> None:
    release, started = threading.Event(), threading.Event()

    def download() -> str:
        started.set()
        release.wait(30)
        return "bytes"

    async def scenario() -> None:
        slots = FetchSlots(1)
        leaving = asyncio.ensure_future(slots.run(time.monotonic() + 30, download))
        await asyncio.to_thread(started.wait, 30)
        leaving.cancel()  # the client went away; its thread is still reading
        with pytest.raises(APIError):
            await slots.run(time.monotonic() + 0.2, lambda: "over the cap")
        release.set()
        assert await slots.run(time.monotonic() + 5, lambda: "next") == "next"
        slots.close()

    asyncio.run(scenario())


def test_slow_downloads_leave_data_urls_and_other_hosts_alone(
        slow_host: tuple[ThreadingCountingServer, Trickle]) -> None:
    """More slow downloads than asyncio's default pool has threads: a data: URL request (on that pool) and a
    fetch from another host (on a free slot) still complete while they hang."""
    srv, trickle = slow_host
    num_slow = 40  # asyncio's default pool has min(32, cpus + 4) threads
    cfg = config(media_fetch_timeout=30.0, max_concurrent_fetches=num_slow + 1,
                 allowed_media_domains=("127.0.0.1", "localhost"))

    async def scenario() -> tuple[int, int]:
        slots = FetchSlots(cfg.max_concurrent_fetches)
        far = time.monotonic() + 60
        slow = [asyncio.ensure_future(slots.run(far, prepare_chat, request(srv.url(f"/slow.png?{i}")), cfg, far))
                for i in range(num_slow)]
        assert await asyncio.to_thread(wait_for, lambda: trickle.active == num_slow)
        inline = await asyncio.to_thread(prepare_chat, request(as_data_url(PNG)), cfg, far)
        other = await slots.run(far, prepare_chat, request(srv.url("/fast.png", "localhost")), cfg, far)
        still_hanging = trickle.active
        trickle.release.set()
        await asyncio.gather(*slow, return_exceptions=True)  # released: the host hangs up on them
        slots.close()
        return len(inline.items) + len(other.items), still_hanging

    assert asyncio.run(scenario()) == (2, num_slow)


def test_a_load_stuck_past_its_deadline_gets_the_408_of_its_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no clock reaches (name resolution), the event loop answers one grace period after the deadline."""
    monkeypatch.setattr("proxy.fetch_slots.GRACE_S", 0.05)
    release = threading.Event()

    async def scenario(**kw: str) -> APIError:
        slots = FetchSlots(1)
        with pytest.raises(APIError) as err:
            await slots.run(time.monotonic() + 0.05, release.wait, 30, **kw)
        slots.close()
        return err.value

    try:
        assert asyncio.run(scenario()).code == "image_fetch_timeout"
        err = asyncio.run(scenario(timeout_code="video_fetch_timeout"))
    finally:
        release.set()
    assert (err.status, err.code) == (408, "video_fetch_timeout")
