"""The workers behind the proxy: encoder fan-out through the scheduler, decoder choice, upstream errors."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any

import httpx

from common.errors import APIError
from common.http import REQUEST_ID_HEADER
from connector import ECConsumer
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics
from scheduler.cache_index import FleetCacheIndex
from scheduler.scheduler import EncoderSlot, MMItem, Scheduler, SchedulerOutput

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


class Fleet:
    def __init__(self, cfg: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics):
        self.cfg, self.client, self.metrics = cfg, client, metrics
        self.consumer = ECConsumer(cache_bytes=0, curve=cfg.curve)  # only asks encoders for snapshots
        self.index = FleetCacheIndex(self.consumer, cfg.curve)
        self.scheduler: Scheduler | None = None
        self.decoder_load = [0] * len(cfg.decode_urls)  # decoder index -> generations in flight

    async def start(self) -> None:
        """Wait for every worker's /health; learn each encoder's ZeroMQ address."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        infos = await asyncio.gather(*(self._wait_healthy(u, deadline) for u in self.cfg.encode_urls))
        await asyncio.gather(*(self._wait_healthy(u, deadline) for u in self.cfg.decode_urls))
        for info in infos:
            self.index.add(info["ec_address"], info["ec_events_address"])
        slots = [EncoderSlot(name=url, ec_address=info["ec_address"], cache=self.index.view(info["ec_address"]))
                 for url, info in zip(self.cfg.encode_urls, infos, strict=True)]
        self.scheduler = Scheduler(slots) if slots else None  # None: aggregated, decoders encode
        addresses = [slot.ec_address for slot in slots]
        if not await asyncio.to_thread(self.index.wait_for, lambda: all(map(self.index.is_synced, addresses)), 5.0):
            logger.warning("cache index not synced with every encoder yet; it will catch up from their events")

    def close(self) -> None:
        self.index.close()
        self.consumer.close()

    async def _wait_healthy(self, url: str, deadline: float) -> dict[str, Any]:
        while True:
            try:
                resp = await self.client.get(f"{url}/health", timeout=5.0)
                if resp.status_code == 200:
                    return dict(resp.json())
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {url} not healthy within {self.cfg.startup_timeout}s")
            await asyncio.sleep(0.2)

    async def encode(self, items: list[MMItem], request_id: str, skip_cached: bool = True) -> dict[str, str]:
        """Make sure every item is held by some encoder; returns mm_hash -> ZeroMQ address."""
        out = await self.schedule(items, skip_cached)
        await self.run_encodes(out, request_id)
        return out.sources

    async def schedule(self, items: list[MMItem], skip_cached: bool = True) -> SchedulerOutput:
        """Decide which encoder holds or will encode each item (no encoding yet)."""
        if not items or self.cfg.aggregated:  # aggregated: the decoder encodes what it is sent
            return SchedulerOutput()
        assert self.scheduler is not None, "fleet not started"
        out = self.scheduler.schedule(items, skip_cached)  # in-memory index: no I/O
        self.metrics.items_skipped.inc(len(out.skipped))
        self.metrics.items_scheduled.inc(out.num_scheduled)
        return out

    async def run_encodes(self, out: SchedulerOutput, request_id: str) -> None:
        """Run the scheduled encode calls in parallel; return once the index has seen what they stored."""
        if not out.scheduled_encoder_inputs:
            return
        start = time.perf_counter()
        await asyncio.gather(*(self._encode_on(i, todo, request_id)
                               for i, todo in out.scheduled_encoder_inputs.items()))
        self.metrics.encode_seconds.observe(time.perf_counter() - start)

    async def _encode_on(self, index: int, items: list[MMItem], request_id: str) -> None:
        assert self.scheduler is not None
        url = self.scheduler.encoders[index].name
        body = {"items": [{"mm_hash": it.mm_hash, "data": base64.b64encode(it.data).decode()} for it in items]}
        try:
            resp = await self.client.post(f"{url}/encode", json=body, headers={REQUEST_ID_HEADER: request_id},
                                          timeout=self.cfg.worker_timeout)
        except httpx.HTTPError as exc:
            raise APIError(503, f"encoder {url} unreachable: {type(exc).__name__}", code="encoder_unavailable") from exc
        finally:
            self.scheduler.update_from_output(index, len(items))
        if resp.status_code != 200:
            raise upstream_error(resp, resp.content, f"encoder {url}")
        await self._seen(resp.json())

    async def _seen(self, encoded: dict[str, Any]) -> None:
        """Read your writes: wait (briefly) until the index has the encoder's events for these items."""
        position = (encoded["ec_address"], encoded["ec_epoch"], encoded["ec_seq"])
        if not self.index.has_seen(*position):
            await asyncio.to_thread(self.index.wait_for, lambda: self.index.has_seen(*position), _SEEN_TIMEOUT_S)

    def acquire_decoder(self) -> int:
        index = min(range(len(self.decoder_load)), key=lambda i: (self.decoder_load[i], i))
        self.decoder_load[index] += 1
        return index

    def release_decoder(self, index: int) -> None:
        self.decoder_load[index] -= 1

    async def open_generation(self, index: int, payload: dict[str, Any], request_id: str) -> httpx.Response:
        """POST /generate on decoder `index`; returns the open streaming response or raises APIError."""
        url = self.cfg.decode_urls[index]
        req = self.client.build_request("POST", f"{url}/generate", json=payload,
                                        headers={REQUEST_ID_HEADER: request_id}, timeout=self.cfg.worker_timeout)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise APIError(503, f"decoder {url} unreachable: {type(exc).__name__}", code="decoder_unavailable") from exc
        if resp.status_code != 200:
            body = await resp.aread()
            await resp.aclose()
            raise upstream_error(resp, body, f"decoder {url}")
        return resp
