"""What every route of the proxy shares, started and stopped by the app's lifespan."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from epd_common.errors import APIError
from epd_common.tracing import inject_traceparent, span
from proxy.config import ProxyConfig
from proxy.fetch_slots import FetchSlots
from proxy.fleet import Fleet
from proxy.kinds import KINDS, media_counts, model_media, remote_kinds
from proxy.metrics import ProxyMetrics
from proxy.prepare import PreparedChat, prepare_chat
from proxy.protocol import ChatCompletionRequest
from proxy.signals import Interrupted, unless_signalled

logger = logging.getLogger("epd.proxy")


class ProxyState:
    """Config, metrics, the image fetch slots, and the fleet once every configured worker answered."""

    def __init__(self, cfg: ProxyConfig, on_ready: Callable[[], None] | None = None,
                 metrics_dir: str | None = None) -> None:
        self.cfg, self.on_ready = cfg, on_ready
        self.metrics = ProxyMetrics(CollectorRegistry(), metrics_dir)
        self.fetch_slots = FetchSlots(cfg.max_concurrent_fetches)  # image downloads at once, all requests together
        self.started: Fleet | None = None

    @property
    def fleet(self) -> Fleet:
        """The fleet; 503 while the proxy is starting."""
        if self.started is None:
            raise APIError(503, "proxy is starting", code="not_ready")
        return self.started

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=self.cfg.worker_timeout,  # traceparent on every call
                                     event_hooks={"request": [inject_traceparent]}) as client:
            fleet = Fleet(self.cfg, client, self.metrics)
            try:
                await unless_signalled(fleet.start())  # SIGTERM / Ctrl-C while waiting for workers: stop
            except Interrupted as exc:
                logger.warning("%s while waiting for workers: stopping", exc)
                await fleet.close()
                yield  # uvicorn saw the signal too: it stops without serving
                return
            except BaseException:
                await fleet.close()
                raise
            self.started = fleet
            logger.info("proxy ready: %d encoder(s), %d decoder(s)", len(self.cfg.encode_urls),
                        len(self.cfg.decode_urls))
            if self.on_ready is not None:
                self.on_ready()
            yield
            await fleet.close()
            self.fetch_slots.close()  # downloads still running are not waited for

    async def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        """Text alone is cheap: no thread hop. Images, videos and audio are loaded (videos and clips probed) within
        --media-fetch-deadline, never on the event loop: downloads on a fetch slot (threads of their own, a cap
        shared by all requests), data and file URLs on asyncio's pool. The fleet's model identity says what its model
        takes of each media kind (proxy/kinds.py). Traced as `prepare` (media fetch
        included)."""
        counts = media_counts(req)
        with span("prepare", {f"epd.{kind.name}s": counts[kind.name] for kind in KINDS}):
            return await self._prepare(req, bool(counts))

    async def _prepare(self, req: ChatCompletionRequest, has_media: bool) -> PreparedChat:
        if not has_media:
            return prepare_chat(req, self.cfg)
        deadline = time.monotonic() + self.cfg.media_fetch_deadline
        fleet = self.started
        model = model_media(fleet.workers.identity if fleet is not None else None,
                            fleet.max_model_len() if fleet is not None else None)
        args = (req, self.cfg, deadline, model.family, model.video, model.max_model_len, model.audio, model.images)
        kinds = remote_kinds(req)
        if kinds:
            code = f"{kinds.pop()}_fetch_timeout" if len(kinds) == 1 else "image_fetch_timeout"
            return await self.fetch_slots.run(deadline, prepare_chat, *args, timeout_code=code)
        return await asyncio.to_thread(prepare_chat, *args)


def proxy_state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state
