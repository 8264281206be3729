"""The workers behind the proxy: encode fan-out with dedupe and failover, decoder calls, upstream errors."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import httpx

from connector import ECConsumer
from epd_common.errors import APIError
from epd_common.http import REQUEST_ID_HEADER
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics
from proxy.workers import ModelMismatch, Worker, WorkerDown, Workers, describe_failure, until_down
from scheduler.cache_index import FleetCacheIndex
from scheduler.scheduler import EncoderSlot, MMItem, NoEncoderAvailable, Scheduler, SchedulerOutput

logger = logging.getLogger("epd.proxy")
_SEEN_TIMEOUT_S = 0.5  # the index normally has an encoder's events before its HTTP reply arrives


def upstream_error(resp: httpx.Response, body: bytes, who: str) -> APIError:
    """Keep the worker's status and message (a 4xx stays a 4xx); unreadable bodies become 502."""
    try:
        err = json.loads(body)["error"]
        return APIError(resp.status_code, str(err.get("message")), param=err.get("param"), code=err.get("code"),
                        extra={"missing": err["missing"]} if "missing" in err else None)
    except (ValueError, KeyError, TypeError):
        return APIError(502, f"{who} answered {resp.status_code}", code="upstream_error")


class WorkerFailed(Exception):
    """A worker could not do the call: the work may be retried elsewhere. `answer` is set when the worker
    answered (a 5xx about this request): it stays in service, the work is retried once on another worker,
    and if that fails too the request ends with this error, so one poison request cannot take the fleet
    out. Without `answer` it was a transport failure (refused, reset, timeout) and the worker is marked down."""

    def __init__(self, reason: str, answer: APIError | None = None):
        super().__init__(reason)
        self.answer = answer


@dataclass
class EncodePlan:
    """A request's scheduled encodes plus, per item still being encoded (by this request or another one),
    a future that resolves to the ZeroMQ address holding it once stored."""

    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    futures: dict[str, asyncio.Future[str]] = field(default_factory=dict)

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self.futures)


def _retrieve(fut: asyncio.Future[str]) -> None:
    """Mark a failed future's exception as seen: its error reaches every request that awaits it."""
    if not fut.cancelled():
        fut.exception()


class Fleet:
    def __init__(self, cfg: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics):
        self.cfg, self.client, self.metrics = cfg, client, metrics
        self.consumer = ECConsumer(cache_bytes=0, curve=cfg.curve)  # only asks encoders for snapshots
        self.index = FleetCacheIndex(self.consumer, cfg.curve)
        self.scheduler = Scheduler()
        self.workers = Workers(client, cfg.health_interval, cfg.health_timeout, cfg.health_failures,
                               on_up=self._on_up, on_down=self._on_down)
        self._encoding: dict[str, asyncio.Future[str]] = {}  # mm_hash -> its encode in flight (dedupe)
        self._calls: set[asyncio.Task[None]] = set()  # encode calls run detached from any one client
        self.internal_headers = {"Authorization": f"Bearer {cfg.internal_key}"} if cfg.internal_key else {}
        metrics.watch(self)

    async def start(self) -> None:
        """Wait for every configured worker's /health (learning each encoder's ZeroMQ address); start probing."""
        for url in self.cfg.encode_urls:
            self.workers.add("encoder", url)
        for url in self.cfg.decode_urls:
            self.workers.add("decoder", url)
        deadline = time.monotonic() + self.cfg.startup_timeout
        await self.workers.wait_healthy([*self.cfg.encode_urls, *self.cfg.decode_urls], deadline)
        addresses = [w.info["ec_address"] for w in self.workers.of("encoder")]
        if not await asyncio.to_thread(self.index.wait_for, lambda: all(map(self.index.is_synced, addresses)), 5.0):
            logger.warning("cache index not synced with every encoder yet; it will catch up from their events")
        self.workers.start()

    async def close(self) -> None:
        await self.workers.stop()
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        self.index.close()
        self.consumer.close()

    # membership

    async def register(self, role: str, url: str) -> Worker:
        """Add a worker at run time (POST /instances); it gets work once its first probe succeeds."""
        worker = self.workers.add(role, url)
        await self.workers.probe(worker)
        if worker.reason.startswith("model_mismatch"):
            reason = worker.reason
            self.workers.remove(url)
            raise ModelMismatch(f"{role} {url} refused: {reason}")
        return worker

    def deregister(self, url: str) -> Worker | None:
        return self.workers.remove(url)

    def _on_up(self, worker: Worker) -> None:
        if worker.role != "encoder":
            return
        address, events = worker.info.get("ec_address"), worker.info.get("ec_events_address")
        if not isinstance(address, str) or not isinstance(events, str):
            self.workers.mark_down(worker, "its /health names no ec_address / ec_events_address")
            return
        slot = self.scheduler.encoders.get(worker.url)
        if slot is None or slot.ec_address != address:  # new, or restarted on another address
            if slot is not None:
                self.index.remove(slot.ec_address)
            self.index.add(address, events)
            self.scheduler.add(EncoderSlot(name=worker.url, ec_address=address, cache=self.index.view(address)))
        self.scheduler.set_healthy(worker.url, True)

    def _on_down(self, worker: Worker) -> None:
        self.metrics.workers_marked_down.labels(worker.role).inc()
        if worker.role == "encoder":
            self.scheduler.set_healthy(worker.url, False)
            if worker.url not in self.workers.by_url:  # deregistered
                self.scheduler.remove(worker.url)

    # encoding

    async def encode(self, items: list[MMItem], request_id: str, skip_cached: bool = True) -> dict[str, str]:
        """Make sure every item is held by some encoder; returns mm_hash -> ZeroMQ address."""
        return await self.execute(self.plan(items, skip_cached), request_id)

    def plan(self, items: list[MMItem], skip_cached: bool = True, exclude: Collection[str] = ()) -> EncodePlan:
        """Schedule the items (no I/O, no await: the in-flight table and the futures change together)."""
        if not items or self.cfg.aggregated:  # aggregated: the decoder encodes what it is sent
            return EncodePlan()
        try:
            out = self.scheduler.schedule(items, skip_cached, exclude)
        except NoEncoderAvailable as exc:
            raise APIError(503, f"cannot encode the images: {exc}", code="encoder_unavailable") from exc
        futures: dict[str, asyncio.Future[str]] = {}
        loop = asyncio.get_running_loop()
        for todo in out.scheduled_encoder_inputs.values():
            for it in todo:
                fut = futures[it.mm_hash] = self._encoding[it.mm_hash] = loop.create_future()
                fut.add_done_callback(_retrieve)
        for h in out.joined:
            futures[h] = self._encoding[h]  # the scheduler's in-flight table and this one change together
        self.metrics.items_skipped.inc(len(out.skipped))
        self.metrics.items_joined.inc(len(out.joined))
        self.metrics.items_scheduled.inc(out.num_scheduled)
        return EncodePlan(out, futures)

    async def execute(self, plan: EncodePlan, request_id: str, exclude: Collection[str] = ()) -> dict[str, str]:
        """Start the plan's encode calls (detached: a client that leaves does not cancel work others joined)
        and wait until every item is stored somewhere; returns mm_hash -> ZeroMQ address."""
        start = time.perf_counter()
        for name, todo in plan.out.scheduled_encoder_inputs.items():
            task = asyncio.create_task(self._encode_call(name, todo, plan.futures, request_id, frozenset(exclude)))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        sources = dict(plan.out.sources)
        for h, fut in plan.futures.items():
            sources[h] = await asyncio.shield(fut)
        if plan.out.scheduled_encoder_inputs:
            self.metrics.encode_seconds.observe(time.perf_counter() - start)
        return sources

    async def _encode_call(self, name: str, items: list[MMItem], futures: dict[str, asyncio.Future[str]],
                           request_id: str, exclude: frozenset[str]) -> None:
        """One encode call; on a worker failure its items are rescheduled on the other encoders."""
        hashes = [it.mm_hash for it in items]
        mine = {h: futures[h] for h in hashes}
        try:
            result = await self._encode_or_failover(name, items, request_id, exclude)
        except APIError as err:
            return _fail(mine, err)
        except asyncio.CancelledError:  # the proxy is shutting down
            _fail(mine, APIError(503, "proxy is shutting down", code="shutting_down"))
            raise
        finally:
            for h, fut in mine.items():
                if self._encoding.get(h) is fut:
                    del self._encoding[h]
        for h, fut in mine.items():
            if not fut.done():
                fut.set_result(result[h])

    async def _encode_or_failover(self, name: str, items: list[MMItem], request_id: str,
                                  exclude: frozenset[str]) -> dict[str, str]:
        hashes = [it.mm_hash for it in items]
        try:
            address = await self._post_encode(name, items, request_id)
            return dict.fromkeys(hashes, address)
        except WorkerFailed as exc:
            if exc.answer is not None and exclude:  # answered 5xx on the retry: the request's own error
                raise exc.answer from exc
            self.metrics.failovers.labels("encoder").inc()
            logger.warning("encoder %s failed (%s); rescheduling %d item(s)", name, exc, len(items))
            failed = exc
        finally:
            self.scheduler.update_from_output(name, hashes)
        try:
            retry = self.plan(items, skip_cached=True, exclude=exclude | {name})  # APIError 503 if nowhere is left
            return await self.execute(retry, request_id, exclude | {name})
        except APIError as err:
            if failed.answer is not None:  # it answered: the request ends with an answer, its own or the retry's
                raise (failed.answer if err.code == "encoder_unavailable" else err) from err
            raise APIError(err.status, f"{err.message} (after encoder {name} failed: {failed})",
                           param=err.param, code=err.code) from err

    async def _post_encode(self, name: str, items: list[MMItem], request_id: str) -> str:
        worker = self.workers.by_url.get(name)
        if worker is None:
            raise WorkerFailed("deregistered")
        body = {"items": [{"mm_hash": it.mm_hash, "data": base64.b64encode(it.data).decode()} for it in items]}
        headers = {REQUEST_ID_HEADER: request_id, **self.internal_headers}
        try:
            resp = await until_down(self.client.post(f"{name}/encode", json=body, headers=headers,
                                                     timeout=self.cfg.worker_timeout), worker)
        except WorkerDown as exc:
            raise WorkerFailed(f"marked down: {worker.reason}") from exc
        except httpx.HTTPError as exc:
            self.workers.mark_down(worker, f"encode call failed: {describe_failure(exc)}")
            raise WorkerFailed(type(exc).__name__) from exc
        if resp.status_code >= 500:
            raise WorkerFailed(f"answered {resp.status_code}", upstream_error(resp, resp.content, f"encoder {name}"))
        if resp.status_code != 200:
            raise upstream_error(resp, resp.content, f"encoder {name}")
        encoded = resp.json()
        await self._seen(encoded)
        return str(encoded["ec_address"])

    async def _seen(self, encoded: dict[str, Any]) -> None:
        """Read your writes: wait (briefly) until the index has the encoder's events for these items."""
        position = (encoded["ec_address"], encoded["ec_epoch"], encoded["ec_seq"])
        if not self.index.has_seen(*position):
            await asyncio.to_thread(self.index.wait_for, lambda: self.index.has_seen(*position), _SEEN_TIMEOUT_S)

    # decoding

    def acquire_decoder(self, exclude: set[str]) -> Worker:
        return self.workers.acquire_decoder(exclude)

    def release_decoder(self, worker: Worker) -> None:
        worker.load -= 1

    def decoder_failed(self, worker: Worker, reason: str, mark_down: bool) -> None:
        self.metrics.failovers.labels("decoder").inc()
        if mark_down:
            self.workers.mark_down(worker, reason)

    async def open_generation(self, worker: Worker, payload: dict[str, Any], request_id: str) -> httpx.Response:
        """POST /generate; returns the open streaming response. Raises WorkerFailed (retry on another decoder)
        or APIError (the request's own fault, or missing embeddings)."""
        req = self.client.build_request("POST", f"{worker.url}/generate", json=payload, timeout=self.cfg.worker_timeout,
                                        headers={REQUEST_ID_HEADER: request_id, **self.internal_headers})
        try:
            resp = await until_down(self.client.send(req, stream=True), worker)
        except WorkerDown as exc:
            raise WorkerFailed(f"marked down: {worker.reason}") from exc
        except httpx.HTTPError as exc:
            self.workers.mark_down(worker, f"generate call failed: {describe_failure(exc)}")
            raise WorkerFailed(type(exc).__name__) from exc
        if resp.status_code != 200:
            body = await resp.aread()
            await resp.aclose()
            if resp.status_code >= 500:
                raise WorkerFailed(f"answered {resp.status_code}", upstream_error(resp, body, f"decoder {worker.url}"))
            raise upstream_error(resp, body, f"decoder {worker.url}")
        return resp


def _fail(futures: dict[str, asyncio.Future[str]], err: APIError) -> None:
    for fut in futures.values():
        if not fut.done():
            fut.set_exception(err)
