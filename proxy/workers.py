"""The proxy's view of its workers: membership (static or registered), health probes, load, marking down."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from common.errors import APIError

logger = logging.getLogger("epd.proxy")
T = TypeVar("T")
ROLES = ("encoder", "decoder")


class WorkerDown(Exception):
    """The worker was marked down while a call to it was in flight."""


@dataclass
class Worker:
    role: str  # "encoder" | "decoder"
    url: str
    healthy: bool = False  # only healthy workers get new work
    failures: int = 0  # consecutive failed probes
    info: dict[str, Any] = field(default_factory=dict)  # its last /health body
    load: int = 0  # decoders: generations in flight
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set when marked down: in-flight calls give up
    reason: str = "not probed yet"

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "load": self.load,
                **({} if self.healthy else {"reason": self.reason})}


async def until_down(call: Awaitable[T], worker: Worker) -> T:
    """Await `call`, but raise WorkerDown (cancelling it) as soon as the worker is marked down."""
    if worker.down.is_set():
        raise WorkerDown(worker.url)
    task = asyncio.ensure_future(call)
    down = asyncio.ensure_future(worker.down.wait())
    try:
        await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        abandoned = not task.done()
        if abandoned:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if abandoned:
        raise WorkerDown(worker.url)
    return task.result()


class Workers:
    """Every worker the proxy knows, by URL. Probes run every `interval` s; `failures_to_down` failed probes
    in a row take a worker out, one good probe brings it back. A failed call (connection refused, reset,
    timed out) takes it out at once: that is stronger evidence than a probe."""

    def __init__(self, client: httpx.AsyncClient, interval: float, timeout: float, failures_to_down: int,
                 on_up: Callable[[Worker], None], on_down: Callable[[Worker], None]):
        self.client, self.interval, self.timeout, self.failures_to_down = client, interval, timeout, failures_to_down
        self.on_up, self.on_down = on_up, on_down
        self.by_url: dict[str, Worker] = {}
        self._task: asyncio.Task[None] | None = None

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.by_url.values() if w.role == role]

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.by_url.values() if w.role == role and w.healthy]

    def add(self, role: str, url: str) -> Worker:
        """Register a worker (idempotent); it takes work once a probe finds it healthy."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        existing = self.by_url.get(url)
        if existing is not None:
            if existing.role != role:
                raise ValueError(f"{url} is already registered as a {existing.role}")
            return existing
        worker = self.by_url[url] = Worker(role=role, url=url)
        logger.info("registered %s %s", role, url)
        return worker

    def remove(self, url: str) -> Worker | None:
        worker = self.by_url.pop(url, None)
        if worker is not None:
            self._set_down(worker, "deregistered")
            logger.info("deregistered %s %s", worker.role, url)
        return worker

    async def wait_healthy(self, urls: list[str], deadline: float) -> None:
        """Probe until each of `urls` answers /health (start-up of static workers)."""
        async def one(url: str) -> None:
            while not await self.probe(self.by_url[url]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {url} not healthy: {self.by_url[url].reason}")
                await asyncio.sleep(0.2)
        await asyncio.gather(*(one(u) for u in urls))

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_forever(), name="epd-health-probes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def probe(self, worker: Worker) -> bool:
        """One GET /health; True if healthy now."""
        try:
            resp = await self.client.get(f"{worker.url}/health", timeout=self.timeout)
            ok, info = resp.status_code == 200, (resp.json() if resp.status_code == 200 else {})
            reason = f"/health answered {resp.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            ok, info, reason = False, {}, f"/health failed: {type(exc).__name__}"
        if worker.url not in self.by_url:  # deregistered while probing
            return False
        if ok:
            worker.failures, worker.info = 0, dict(info)
            if not worker.healthy:
                worker.healthy, worker.down = True, asyncio.Event()
                logger.info("%s %s is healthy", worker.role, worker.url)
            self.on_up(worker)  # also when already up: an encoder may have restarted on a new address
            return True
        worker.failures += 1
        if worker.failures >= self.failures_to_down or not worker.info:
            self.mark_down(worker, f"{worker.failures} failed probe(s): {reason}")
        return False

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("%s %s marked down: %s", worker.role, worker.url, reason)
        self._set_down(worker, reason)

    def acquire_decoder(self, exclude: set[str]) -> Worker:
        """The healthy decoder with the fewest generations in flight, not in `exclude`; its load goes up by one."""
        candidates = [w for w in self.healthy("decoder") if w.url not in exclude]
        if not candidates:
            raise APIError(503, "no healthy decoder is available", code="decoder_unavailable")
        worker = min(candidates, key=lambda w: w.load)
        worker.load += 1
        return worker

    def _set_down(self, worker: Worker, reason: str) -> None:
        was_healthy = worker.healthy
        worker.healthy, worker.reason = False, reason
        worker.down.set()
        if was_healthy:
            self.on_down(worker)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.gather(*(self.probe(w) for w in list(self.by_url.values())))
