"""The workers behind the proxy as one fleet: membership and health (proxy/workers.py), the encoders' cache index
and scheduler, a request's encodes (proxy/encode_calls.py runs the calls), and its decoder calls."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import httpx
import msgspec

from connector.control.cache_index import FleetCacheIndex
from epd_common.errors import APIError
from epd_common.http import REQUEST_ID_HEADER
from epd_contracts.generate import GenerateRequest
from proxy.config import ProxyConfig
from proxy.decoder_http import DecoderHTTP, DecoderResponse
from proxy.encode_calls import EncodeCalls, encode_calls
from proxy.metrics import ProxyMetrics
from proxy.upstream import ItemRefused, WorkerFailed, upstream_error
from proxy.worker_state import Worker, WorkerDown, describe_failure, until_down
from proxy.workers import ModelMismatch, Workers
from scheduler.scheduler import EncoderSlot, MMItem, Scheduler, SchedulerOutput

logger = logging.getLogger("epd.proxy")


class Fleet:
    """Every worker the proxy sends work to, and the calls it makes to them."""

    def __init__(self, cfg: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics):
        self.cfg, self.client, self.metrics = cfg, client, metrics
        self.decoder_http = DecoderHTTP(cfg.worker_timeout)  # the /generate streams; httpx for every other call
        self.index = FleetCacheIndex(cfg.curve)
        self.scheduler = Scheduler(index=self.index)
        self.workers = Workers(client, cfg.health_interval, cfg.health_timeout, cfg.health_failures,
                               on_up=self._on_up, on_down=self._on_down,
                               load_gap=cfg.affinity_load_gap if cfg.prefix_affinity else None,
                               on_route=lambda route: metrics.affinity_routed.labels(route).inc())
        self.internal_headers = {"Authorization": f"Bearer {cfg.internal_key}"} if cfg.internal_key else {}
        self.calls = EncodeCalls(cfg, client, metrics, self.scheduler, self.index, self.workers, self.internal_headers)
        metrics.watch(self)

    async def start(self) -> None:
        """Wait for every configured worker's /health (learning each encoder's ZeroMQ address); start probing."""
        roles = {"encoder": self.cfg.encode_urls, "decoder": self.cfg.decode_urls, "prefill": self.cfg.prefill_urls}
        for role, urls in roles.items():
            for url in urls:
                self.workers.add(role, url)
        deadline = time.monotonic() + self.cfg.startup_timeout
        await self.workers.wait_healthy([url for urls in roles.values() for url in urls], deadline)
        addresses = [w.info["ec_address"] for w in self.workers.of("encoder")]
        if not await asyncio.to_thread(self.index.wait_for, lambda: all(map(self.index.is_synced, addresses)), 5.0):
            logger.warning("cache index not synced with every encoder yet; it will catch up from their events")
        self.workers.start()

    def max_model_len(self) -> int | None:
        """The longest context any decoder reports on /health (None: none says): what a prompt surely cannot pass."""
        lengths = [n for w in self.workers.of("decoder") if isinstance(n := w.info.get("max_model_len"), int)
                   and not isinstance(n, bool) and n > 0]
        return max(lengths, default=None)

    def healthy_count(self, role: str) -> int:
        """Healthy workers of `role` (the metrics' gauge)."""
        return len(self.workers.healthy(role))

    def items_outstanding(self) -> int:
        """Items sent to encoders and not finished (the metrics' gauge)."""
        return sum(self.scheduler.outstanding.values())

    def served_model_name(self) -> str | None:
        """--served-model-name, else the name of the model the workers report (None until one has)."""
        return self.cfg.served_model_name or self.workers.model_name

    async def close(self) -> None:
        await self.workers.stop()
        await self.calls.close()
        self.decoder_http.close()
        self.index.close()

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

    def plan(self, items: list[MMItem], skip_cached: bool = True) -> SchedulerOutput:
        """Schedule the items (no I/O): the scheduler records each encode in flight with its future."""
        if not items or self.cfg.aggregated:  # aggregated: the decoder encodes what it is sent
            return SchedulerOutput()
        return self.calls.schedule(items, skip_cached, ())

    async def execute(self, plan: SchedulerOutput, request_id: str) -> dict[str, str]:
        """Start the plan's encode calls (detached: a client that leaves does not cancel work others joined)
        and wait until every item is stored somewhere; returns mm_hash -> ZeroMQ address."""
        start = time.perf_counter()
        for name, todo in plan.scheduled_encoder_inputs.items():
            for call in encode_calls(todo):
                self.calls.start(name, call, request_id)
        sources = dict(plan.sources)
        for h, result in plan.waits.items():
            try:
                sources[h] = await asyncio.shield(asyncio.wrap_future(result))
            except APIError as err:
                if err.status < 500 and (err.param or "").startswith("items."):
                    raise ItemRefused(err, h) from err
                raise
        if plan.scheduled_encoder_inputs:
            self.metrics.encode_seconds.observe(time.perf_counter() - start)
        return sources

    # decoding (and prefill workers: E -> P -> D)
    def acquire_decoder(self, exclude: set[str], prefix_keys: Sequence[str] = (), role: str = "decoder",
                        lora: str = "") -> Worker:
        return self.workers.acquire_decoder(exclude, prefix_keys, role, lora)

    @property
    def splits_prefill(self) -> bool:  # E -> P -> D: prefill workers configured or registered; requests start there
        return not self.cfg.aggregated and bool(self.workers.of("prefill"))

    def release_decoder(self, worker: Worker, finished_keys: Sequence[str] = ()) -> None:
        """The generation is over; `finished_keys`: it finished there, so the decoder holds their K/V now."""
        worker.load -= 1
        if finished_keys:
            worker.prefixes.finished(finished_keys)

    def decoder_failed(self, worker: Worker, reason: str, mark_down: bool) -> None:
        self.metrics.failovers.labels("decoder").inc()
        if mark_down:
            self.workers.mark_down(worker, reason)

    async def open_generation(self, worker: Worker, generate: GenerateRequest, request_id: str) -> DecoderResponse:
        """POST /generate (proxy/decoder_http.py); returns the open streaming response. Raises WorkerFailed (retry
        on another decoder) or APIError (the request's own fault, or missing embeddings)."""
        headers = {REQUEST_ID_HEADER: request_id, "content-type": "application/json", **self.internal_headers}
        try:
            resp = await until_down(self.decoder_http.post_stream(worker.url, "/generate", msgspec.json.encode(generate),
                                                                  headers), worker)
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
