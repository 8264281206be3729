"""OpenTelemetry traces across the processes, exported over real OTLP/HTTP: a launcher stack (proxy, encoder,
decoder, secure by default) with --otlp-traces-endpoint pointed at a receiver in this test, which decodes the
protobuf (opentelemetry-proto). One sampled request makes one trace with spans from all three processes, each
parented by the span that called it (the client's traceparent, the proxy's encode span, the decoder's gather span
through the connector's get header); a request whose traceparent says "not sampled" exports nothing anywhere."""
from __future__ import annotations

import base64
import os
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from connector.tensors.shm import SHM_MIN_BYTES
from tests.e2e.stack import Stack, ask_colour, demo_png, launched

pytestmark = pytest.mark.e2e


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, as a dict, by trace id."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, export: ExportTraceServiceRequest) -> None:
        got = []
        for resource_spans in export.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    got.append({"service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "kind": s.kind, "attrs": attributes(s.attributes),
                                "events": [e.name for e in s.events],
                                "event_attrs": [attributes(e.attributes) for e in s.events]})
        with self.changed:
            self.spans += got
            self.changed.notify_all()

    def trace(self, trace_id: str, until: set[tuple[str, str]], timeout: float = 60) -> dict[tuple[str, str], Any]:
        """The trace's spans by (service, name), once every one in `until` has come."""
        def spans() -> dict[tuple[str, str], Any]:
            return {(s["service"], s["name"]): s for s in self.spans if s["trace"] == trace_id}
        with self.changed:
            assert self.changed.wait_for(lambda: until <= set(spans()), timeout), sorted(spans())
            return spans()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(kvs: Any) -> dict[str, Any]:
    """OTLP key-values as a dict (an array as a list)."""
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return {kv.key: value(kv.value) for kv in kvs}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Receiver]]:
    receiver = Receiver()
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("EPD_")}  # keys made per start
    try:
        with launched(tmp_path_factory.mktemp("traced"), "--model", "demo", "--num-encoders", "1",
                      "--num-decoders", "1", "--otlp-traces-endpoint", receiver.url,
                      "--allowed-media-domains", "127.0.0.1",  # the image server of test_one_trace_holds_...
                      "--otlp-traces-sample-ratio", "0") as stack:  # only requests that say "sampled" are traced
            yield stack, receiver
    finally:
        os.environ.update(env)
        receiver.close()


def traceparent(sampled: bool) -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


PROXY, ENCODER, DECODER = "epd-proxy", "epd-encoder", "epd-decoder"
CHAT, ENCODE, GENERATE = "POST /v1/chat/completions", "POST /encode", "POST /generate"


def test_one_request_is_one_trace_across_proxy_encoder_and_decoder(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    trace_id, client_span, header = traceparent(sampled=True)
    resp = ask_colour(stack.base_url, demo_png("red", 41), headers={"traceparent": header})
    assert resp.status_code == 200, resp.text
    spans = receiver.trace(trace_id, {(PROXY, CHAT), (PROXY, "prepare"), (PROXY, "encode"), (ENCODER, ENCODE),
                                      (ENCODER, "encode"), (DECODER, GENERATE), (DECODER, "gather"),
                                      (ENCODER, "ec.get"), (DECODER, "queue"), (DECODER, "prefill"),
                                      (DECODER, "decode")})

    def parent(service: str, name: str) -> tuple[str, str]:
        found = [k for k, s in spans.items() if s["id"] == spans[(service, name)]["parent"]]
        return found[0] if found else ("client", spans[(service, name)]["parent"])

    assert spans[(PROXY, CHAT)]["parent"] == client_span  # the client's traceparent
    assert parent(PROXY, "prepare") == parent(PROXY, "encode") == (PROXY, CHAT)
    assert parent(ENCODER, ENCODE) == (PROXY, "encode")  # the proxy's call carried its span
    assert parent(ENCODER, "encode") == (ENCODER, ENCODE)
    assert parent(DECODER, GENERATE) == (PROXY, CHAT)
    assert parent(DECODER, "gather") == (DECODER, GENERATE)
    assert parent(ENCODER, "ec.get") == (DECODER, "gather")  # through the connector's get header
    for name in ("queue", "prefill", "decode"):  # the engine's times, as spans of the request's own
        assert parent(DECODER, name) == (DECODER, GENERATE)
    assert "first_token" in spans[(DECODER, GENERATE)]["events"]
    assert {s["service"] for s in spans.values()} == {PROXY, ENCODER, DECODER}


def test_a_request_that_is_not_sampled_sends_nothing(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    quiet_id, _, quiet = traceparent(sampled=False)
    assert ask_colour(stack.base_url, demo_png("blue", 42), headers={"traceparent": quiet}).status_code == 200
    loud_id, _, loud = traceparent(sampled=True)  # after it: once this one's spans are in, the first's would be too
    assert ask_colour(stack.base_url, demo_png("green", 43), headers={"traceparent": loud}).status_code == 200
    receiver.trace(loud_id, {(PROXY, CHAT), (ENCODER, ENCODE), (DECODER, GENERATE), (DECODER, "decode")})
    assert [s for s in receiver.spans if s["trace"] == quiet_id] == []
    # with --otlp-traces-sample-ratio 0, a request without a traceparent is not traced either
    assert ask_colour(stack.base_url, demo_png("red", 44)).status_code == 200


@pytest.mark.parametrize("junk", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-" + "a" * 32 + "-" + "b" * 16
                                  + "-01", "00-" + "a" * 32 + "-" + "b" * 16 + "-01-extra" * 50])
def test_a_malformed_traceparent_is_ignored_and_the_request_answered(traced: tuple[Stack, Receiver],
                                                                   junk: str) -> None:
    stack, receiver = traced
    assert ask_colour(stack.base_url, demo_png("red", 45), headers={"traceparent": junk}).status_code == 200
    loud_id, _, loud = traceparent(sampled=True)  # once this one's spans are in, the junk one's would be too
    assert ask_colour(stack.base_url, demo_png("red", 46), headers={"traceparent": loud}).status_code == 200
    receiver.trace(loud_id, {(PROXY, CHAT), (DECODER, GENERATE)})
    assert not [s for s in receiver.spans if s["trace"] in junk]  # not continued (and ratio 0: no new root)


@pytest.fixture(scope="module")
def media() -> Iterator[str]:
    """An image host on loopback: GET /<anything> answers a PNG; the URL's query is a token no span may show."""
    image = demo_png("green", 47)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/private/picture.png?token={SECRET}"
    finally:
        server.shutdown()
        server.server_close()


SECRET = "s3cr3t-" + secrets.token_hex(8)


def ask_urls(stack: Stack, urls: list[str], header: str) -> httpx.Response:
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
               {"type": "text", "text": "What color is the shape?"}]
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers={"traceparent": header}, timeout=60)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_one_trace_holds_media_fetches_scheduling_batches_gather_transport_and_prefill_chunks(
        traced: tuple[Stack, Receiver], media: str) -> None:
    stack, receiver = traced
    trace_id, _, header = traceparent(sampled=True)
    assert ask_urls(stack, [media, data_url(demo_png("blue", 48))], header).status_code == 200
    spans = receiver.trace(trace_id, {(PROXY, "prepare"), (PROXY, "media.fetch"), (PROXY, "encode"),
                                      (ENCODER, "encode"), (DECODER, "gather"), (DECODER, "prefill")})
    fetch, prepare = spans[(PROXY, "media.fetch")], spans[(PROXY, "prepare")]
    assert fetch["parent"] == prepare["id"]  # the fetch thread runs in the request's context
    assert fetch["attrs"] == {"epd.kind": "image", "url.scheme": "http", "server.address": "127.0.0.1",
                              "epd.bytes": len(demo_png("green", 47))}  # one span: the data URL needs none
    assert [s for s in spans.values() if s["name"] == "media.fetch"] == [fetch]
    assert not [s for s in receiver.spans if SECRET in repr(s)]  # the URL's path and query are in no span
    encode = spans[(PROXY, "encode")]["attrs"]
    assert (encode["epd.items.skipped"], encode["epd.items.joined"], encode["epd.items.sent"]) == (0, 0, 2)
    batches = spans[(ENCODER, "encode")]["attrs"]
    assert batches["epd.items.encoded"] == 2 and all(isinstance(b, int) and b > 0 for b in batches["epd.batch_ids"])
    assert len(batches["epd.batch_sizes"]) == len(batches["epd.batch_ids"]) and sum(batches["epd.batch_sizes"]) >= 2
    gather = spans[(DECODER, "gather")]["attrs"]
    # the demo's embeddings are under SHM_MIN_BYTES: held on the encoder's heap, sent as frames (shm: tests/connector)
    assert gather["epd.bytes.fetched"] == gather["epd.bytes"] < SHM_MIN_BYTES and gather["epd.transport"] == "socket"
    prefill = spans[(DECODER, "prefill")]
    chunks = [a["epd.tokens"] for name, a in zip(prefill["events"], prefill["event_attrs"], strict=True)
              if name == "prefill_chunk"]
    assert chunks and prefill["attrs"]["epd.chunks"] == len(chunks)
    assert sum(chunks) == prefill["attrs"]["epd.prompt_tokens"] - prefill["attrs"]["epd.reused_tokens"]

    again_id, _, again = traceparent(sampled=True)  # the same picture, once the proxy knows an encoder holds it
    for _ in range(50):
        assert ask_urls(stack, [media], again).status_code == 200
        skipped = receiver.trace(again_id, {(PROXY, "encode")})[(PROXY, "encode")]["attrs"]
        if skipped["epd.items.skipped"]:
            break
        again_id, _, again = traceparent(sampled=True)  # the encoder's cache event had not come yet: again
    assert (skipped["epd.items.skipped"], skipped["epd.items.sent"]) == (1, 0)
