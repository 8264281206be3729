"""Tracing off (the default) is free: no OpenTelemetry SDK is imported, no span is made, no traceparent goes out;
the flags are checked and passed on as given. Tracing on, in-process: spans follow the sampled flag of their
parent and the engine's recorded times (epd_common/tracing.py; the cross-process trace: tests/e2e/test_tracing.py)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from epd_common import tracing
from epd_common.tracing import TraceSettings, add_tracing_flags, tracing_flags


def test_a_server_without_an_endpoint_imports_no_sdk_and_makes_no_span() -> None:
    code = ("import sys; from proxy.app import create_app; from proxy.config import ProxyConfig; "
            "from epd_common import tracing; "
            "create_app(ProxyConfig(encode_urls=('http://127.0.0.1:9',), decode_urls=('http://127.0.0.1:9',))); "
            "assert not tracing.enabled() and tracing.traceparent() == ''; "
            "s = tracing.span('x'); assert s.__enter__() is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tracing_flags(p)
    return p.parse_args(argv)


def test_the_flags_default_off_refuse_a_ratio_outside_0_1_and_pass_on_as_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = parse()
    assert (args.otlp_traces_endpoint, args.otlp_traces_sample_ratio) == (None, 1.0)
    assert tracing_flags(TraceSettings()) == []
    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit):
            parse("--otlp-traces-sample-ratio", bad)
    assert "--otlp-traces-sample-ratio" in capsys.readouterr().err
    given = parse("--otlp-traces-endpoint", "http://c:4318/v1/traces", "--otlp-traces-sample-ratio", "0.01")
    settings = TraceSettings(otlp_traces_endpoint=given.otlp_traces_endpoint,
                             otlp_traces_sample_ratio=given.otlp_traces_sample_ratio)
    assert parse(*tracing_flags(settings)) == given  # what a spawned worker gets parses to the same settings


@pytest.fixture
def exported() -> Iterator[list]:
    """Tracing on in this process, spans kept in memory instead of exported (restored after)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    memory = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing._state.update(tracer=provider.get_tracer("t"), provider=provider,
                          propagator=TraceContextTextMapPropagator())
    try:
        yield memory.get_finished_spans  # type: ignore[misc]
    finally:
        tracing.stop_tracing()


def test_spans_follow_their_parents_sampled_flag_and_carry_it_on(exported) -> None:  # type: ignore[no-untyped-def]
    sampled, unsampled = "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "00-" + "c" * 32 + "-" + "d" * 16 + "-00"
    with tracing.span("served", parent=sampled, kind="server"):
        outgoing = tracing.traceparent()
        tracing.record("queue", 1.0, 1.5, {"epd.x": 1}, events=[("first_token", 1.2)])
    with tracing.span("quiet", parent=unsampled, kind="server"):
        assert tracing.traceparent().endswith("-00")  # the decision goes downstream too
    with tracing.span("no parent, ratio 0"):
        pass
    spans = {s.name: s for s in exported()}
    assert set(spans) == {"served", "queue"}
    served, queue = spans["served"], spans["queue"]
    assert f"{served.context.trace_id:032x}" == "a" * 32 and f"{served.parent.span_id:016x}" == "b" * 16
    assert outgoing == f"00-{'a' * 32}-{served.context.span_id:016x}-01"
    assert queue.parent.span_id == served.context.span_id
    assert queue.end_time - queue.start_time == 500_000_000 and queue.events[0].name == "first_token"
