"""A fake fleet for the planner: a proxy's /instances and /metrics, one encoder's and one decoder's /metrics and the
decoder's /health, as Prometheus text; served through httpx.MockTransport (`transport`) or on loopback
(`serve_fleet`). Any path's answer can be replaced (`answers`) by a hostile one."""
from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from tests.loopback_http import LoopbackServer, QuietHandler

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
Answer = Callable[[], tuple[int, bytes]]  # (status, body)


def histogram(name: str, observations: list[float]) -> str:
    """A Prometheus histogram's lines for these observations."""
    lines = [f"# TYPE {name} histogram"]
    for le in (*BOUNDS, math.inf):
        le_text = "+Inf" if math.isinf(le) else repr(float(le))
        lines.append(f'{name}_bucket{{le="{le_text}"}} {sum(1 for o in observations if o <= le)}')
    lines += [f"{name}_sum {sum(observations)}", f"{name}_count {len(observations)}"]
    return "\n".join(lines)


@dataclass
class FakeFleet:
    """State the test sets between reads; `busy_share` makes the encoder's run seconds grow with the clock."""

    base: str = "http://fleet.test"
    busy_share: float = 0.0  # of wall time the encoder is busy (read at answer time)
    kv_free: int = 1000  # of 1000 decoder blocks
    waiting: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    queue_wait: list[float] = field(default_factory=list)
    answers: dict[str, Answer] = field(default_factory=dict)  # path -> a replacement answer
    seen_auth: list[str] = field(default_factory=list)  # the Authorization header of each /instances call
    start: float = field(default_factory=time.monotonic)
    release: threading.Event = field(default_factory=threading.Event)  # set when its server closes

    def hanging(self) -> tuple[int, bytes]:
        """An answer that never comes while the test runs (the planner's timeout must give up on it first)."""
        self.release.wait(60)
        return 200, b""

    @property
    def encoder_url(self) -> str:
        return f"{self.base}/encoder-0"

    @property
    def decoder_url(self) -> str:
        return f"{self.base}/decoder-0"

    def answer(self, path: str, auth: str) -> tuple[int, bytes]:
        if path in self.answers:
            return self.answers[path]()
        if path == "/instances":
            self.seen_auth.append(auth)
            body = {"encoders": [{"url": self.encoder_url, "healthy": True, "load": 0}],
                    "decoders": [{"url": self.decoder_url, "healthy": True, "load": 0}], "prefills": []}
            return 200, json.dumps(body).encode()
        texts = {"/metrics": self.proxy_text, "/encoder-0/metrics": self.encoder_text,
                 "/decoder-0/metrics": self.decoder_text, "/decoder-0/health": lambda: '{"max_num_seqs": 32}'}
        return (200, texts[path]().encode()) if path in texts else (404, b"{}")

    def proxy_text(self) -> str:
        return "\n".join([histogram("epd_proxy_time_to_first_token_seconds", self.ttft),
                          histogram("epd_proxy_inter_token_latency_seconds", self.itl),
                          "# TYPE epd_proxy_requests counter", f'epd_proxy_requests_total{{endpoint="chat",'
                          f'status="200"}} {len(self.ttft)}', ""])

    def encoder_text(self) -> str:
        busy = self.busy_share * (time.monotonic() - self.start)
        return "\n".join(["# TYPE epd_encoder_run_seconds counter", f"epd_encoder_run_seconds_total {busy}",
                          "# TYPE epd_encoder_items_encoded counter",
                          f"epd_encoder_items_encoded_total {len(self.queue_wait)}",
                          histogram("epd_encoder_queue_wait_seconds", self.queue_wait), ""])

    def decoder_text(self) -> str:
        return "\n".join([f"epd_decoder_kv_blocks_total 1000\nepd_decoder_kv_blocks_free {self.kv_free}",
                          f"epd_decoder_waiting {self.waiting}", "epd_decoder_generated_tokens_total 0",
                          *(histogram(f"epd_decoder_request_{n}_time_seconds", []) for n in ("queue", "prefill",
                                                                                               "decode")), ""])

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            status, body = self.answer(request.url.path, request.headers.get("authorization", ""))
            return httpx.Response(status, content=body)
        return httpx.MockTransport(handle)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport(), timeout=1.0)


@contextmanager
def serve_fleet(fleet: FakeFleet) -> Iterator[FakeFleet]:
    """The fleet on a loopback port (its `base` set to it) until the block ends; a handler blocked in
    `FakeFleet.hanging` is let go first."""
    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body = fleet.answer(self.path, self.headers.get("authorization", ""))
            self.send_body(status, body, "text/plain")

    server = LoopbackServer(Handler)
    fleet.base = server.url
    try:
        yield fleet
    finally:
        fleet.release.set()
        server.close()
