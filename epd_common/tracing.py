"""OpenTelemetry traces across the processes (`--otlp-traces-endpoint`, vLLM's flag).

Off by default, and then free: the OpenTelemetry SDK and its OTLP exporter (the `tracing` extra) are imported only
by `start_tracing` with an endpoint, and every helper here (the server middleware included) returns at once while
tracing is off. On, each process exports its spans over OTLP/HTTP (protobuf) with its own `service.name`, and
the W3C `traceparent` carries a request's trace from process to process: a client's header into the proxy, the
proxy's calls to `/encode` and `/generate` (an httpx event hook), and the decoder's connector gets (a field of the
get header), so one trace holds a request's spans in every process it crossed. Sampling: a request without a
`traceparent` is traced with probability `--otlp-traces-sample-ratio`; one with a `traceparent` follows its
sampled flag (a client's unsampled request, and everything it causes downstream, sends nothing).

Spans of the engine thread are never made there: the engine records times (perf_counter) and `record` turns them
into finished spans afterwards, on the request's own thread.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd_common.startup import ConfigError

logger = logging.getLogger("epd.tracing")

TRACEPARENT = "traceparent"
MAX_TRACEPARENT = 64  # a W3C version-00 traceparent is 55 characters
_EPOCH_NS = time.time_ns() - time.perf_counter_ns()  # perf_counter -> the epoch OTLP timestamps count from
_state: dict[str, Any] = {}  # "tracer", "provider", "propagator" while tracing is on in this process


@dataclass(frozen=True, kw_only=True)
class TraceSettings:
    """Every program's tracing flags (its config inherits them)."""

    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; None: off
    otlp_traces_sample_ratio: float = 1.0  # share of requests without a traceparent that are traced


def add_tracing_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tracing (OpenTelemetry, needs the `tracing` extra)")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="export OpenTelemetry traces over OTLP/HTTP to this URL, e.g. "
                        "http://127.0.0.1:4318/v1/traces (default: off, and no tracing code runs)")
    g.add_argument("--otlp-traces-sample-ratio", type=_ratio, default=1.0,
                   help="share of requests without a W3C traceparent that are traced, 0..1 (a request with one "
                        "follows its sampled flag)")


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within 0..1, got {text}")
    return value


def tracing_flags(settings: TraceSettings) -> list[str]:
    """The flags that give a spawned worker the same tracing (the launcher passes them on)."""
    if not settings.otlp_traces_endpoint:
        return []
    return ["--otlp-traces-endpoint", settings.otlp_traces_endpoint,
            "--otlp-traces-sample-ratio", repr(settings.otlp_traces_sample_ratio)]


def require_sdk() -> None:
    """ConfigError naming the `tracing` extra when the OpenTelemetry SDK or its OTLP exporter cannot be imported (a
    program checks this before it loads anything, when --otlp-traces-endpoint is given)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter, the `tracing` "
                          f"extra: pip install 'disagg-epd[tracing]' ({exc})") from None


def start_tracing(service: str, settings: TraceSettings) -> bool:
    """Turn tracing on in this process when an endpoint is set; ConfigError naming the extra when it is missing."""
    if not settings.otlp_traces_endpoint or _state:
        return bool(_state)
    require_sdk()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              sampler=ParentBased(TraceIdRatioBased(settings.otlp_traces_sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint),
                                                   schedule_delay_millis=500))
    _state.update(tracer=provider.get_tracer("epd"), provider=provider, propagator=TraceContextTextMapPropagator())
    logger.info("tracing on: OTLP/HTTP to %s, sample ratio %g", settings.otlp_traces_endpoint,
                settings.otlp_traces_sample_ratio)
    return True


def stop_tracing() -> None:
    """Export what is buffered and turn tracing off (a server's shutdown)."""
    provider = _state.pop("provider", None)
    _state.clear()
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return bool(_state)


def _kind(name: str) -> Any:
    from opentelemetry.trace import SpanKind
    return {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}[name]


@contextlib.contextmanager
def span(name: str, attributes: dict[str, Any] | None = None, kind: str = "internal",
         parent: str | None = None, record_exception: bool = True) -> Iterator[Any]:
    """A child of the current span (or of `parent`, a traceparent), current while the block runs; None when off.
    An exception out of the block marks the span failed (and, with `record_exception`, adds its traceback)."""
    if not _state:
        yield None
        return
    from opentelemetry import context
    ctx = _state["propagator"].extract({TRACEPARENT: parent}) if parent else context.get_current()
    with _state["tracer"].start_as_current_span(name, context=ctx, kind=_kind(kind), attributes=attributes,
                                                record_exception=record_exception) as s:
        yield s


Event = tuple[str, float] | tuple[str, float, dict[str, Any]]  # (name, perf_counter() time[, attributes])


def record(name: str, start_s: float, end_s: float, attributes: dict[str, Any] | None = None,
           events: Sequence[Event] = ()) -> None:
    """A finished child of the current span from perf_counter() times (what an engine thread noted), with `events`."""
    if not _state:
        return
    s = _state["tracer"].start_span(name, start_time=_ns(start_s), attributes=attributes)
    for event, at, *attrs in events:
        s.add_event(event, attributes=attrs[0] if attrs else None, timestamp=_ns(at))
    s.end(end_time=_ns(max(start_s, end_s)))


def add_event(name: str, at: float, attributes: dict[str, Any] | None = None) -> None:
    """An event on the current span at perf_counter() time `at`."""
    if _state:
        from opentelemetry import trace
        trace.get_current_span().add_event(name, attributes=attributes, timestamp=_ns(at))


def _ns(perf_s: float) -> int:
    return _EPOCH_NS + int(perf_s * 1e9)


def traceparent() -> str:
    """The current span's W3C traceparent ("" when off or outside any span): what a call to another process
    carries."""
    if not _state:
        return ""
    carrier: dict[str, str] = {}
    _state["propagator"].inject(carrier)
    return carrier.get(TRACEPARENT, "")


async def inject_traceparent(request: Any) -> None:
    """httpx request hook: the calling task's span goes with the request."""
    if _state and (tp := traceparent()):
        request.headers[TRACEPARENT] = tp


class TraceMiddleware:
    """A SERVER span for each request to one of `paths`, parented by the request's `traceparent`, current while the
    app answers (its whole body, streamed ones included)."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...]) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or not _state:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"}
        status: list[int] = []

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        with span(f"{scope['method']} {scope['path']}", {"http.route": scope["path"]}, "server",
                  headers.get(TRACEPARENT)) as s:
            await self.app(scope, receive, sending)
            if s is not None and status:
                s.set_attribute("http.response.status_code", status[0])


def install_tracing(app: Any, paths: tuple[str, ...]) -> None:
    """Server spans for `paths` once tracing is on in this process (until then the middleware passes through)."""
    app.add_middleware(TraceMiddleware, paths=paths)
