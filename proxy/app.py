"""The OpenAI-compatible front door: /v1/chat/completions, /v1/models, /health, /ready, /instances, /metrics."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from prometheus_client import Counter, Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd_common.errors import install_error_handlers
from epd_common.http import BodyLimit, install_api_key, install_metrics, install_request_id
from epd_common.tracing import install_tracing, start_tracing
from proxy import lora_admin
from proxy.config import ProxyConfig
from proxy.routes import router
from proxy.state import ProxyState

_COUNTED = ("/v1/chat/completions", "/v1/completions")  # epd_proxy_requests_total{status}


class _LimitsAndCounts:
    """Pure ASGI: the body limits (epd_common/http.py BodyLimit: 413 past the bytes received, chunked or not,
    408 past the read deadline); chat and text completions counted by status, those refusals included, and an
    unexpected exception as the 500 Starlette's outermost layer answers for it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_read_timeout: float, requests: Counter,
                 in_flight: Gauge) -> None:
        self.app, self.requests = BodyLimit(app, max_body_bytes, body_read_timeout), requests
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _COUNTED:
            return await self.app(scope, receive, send)
        started, endpoint = False, scope["path"]

        async def count(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        self.in_flight.inc()
        try:
            await self.app(scope, receive, count)
        except Exception:
            if not started:  # ServerErrorMiddleware (outside this layer) answers it: a 500
                self.requests.labels(endpoint, "500").inc()
            raise
        finally:
            self.in_flight.dec()


def create_app(cfg: ProxyConfig, on_ready: Callable[[], None] | None = None,
               metrics_dir: str | None = None) -> FastAPI:
    """The app around one ProxyState (app.state.proxy), which its lifespan starts and stops. `metrics_dir`: one of
    several proxy processes (--proxy-workers N) in prometheus_client's multiprocess mode: /metrics adds them up."""
    state = ProxyState(cfg, on_ready, metrics_dir)
    # with an API key, the OpenAPI document needs it too, and the browser pages (which fetch it without the key) are
    # off; without one, all three are open like the rest of the API
    app = FastAPI(title="EPD proxy", lifespan=state.lifespan, docs_url=None if cfg.api_key else "/docs",
                  redoc_url=None if cfg.api_key else "/redoc")
    app.state.proxy = state
    install_error_handlers(app)
    start_tracing("epd-proxy", cfg)  # --otlp-traces-endpoint: this process's spans (each proxy process its own)
    install_tracing(app, ("/v1/chat/completions", "/v1/completions"))
    install_metrics(app, state.metrics.scrape)
    install_api_key(app, cfg.api_key, ("/v1/", "/openapi.json"))  # inside the counting middleware: 401s are counted too
    app.add_middleware(_LimitsAndCounts, max_body_bytes=cfg.max_body_bytes, body_read_timeout=cfg.body_read_timeout,
                       requests=state.metrics.requests, in_flight=state.metrics.in_flight)
    install_request_id(app)  # outermost: the id is set before anything else runs
    app.include_router(router)
    app.include_router(lora_admin.router)
    return app
