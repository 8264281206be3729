"""A fake encoder on loopback: /health names a real ECProducer's addresses (so the proxy's cache index syncs with it),
/encode records each call's items and answers them as encoded, storing nothing (the fake decoder gathers nothing)."""
from __future__ import annotations

import json
import threading
from typing import Any

from connector.tensors.producer import ECProducer
from tests.loopback_http import LoopbackServer, QuietHandler


class FakeEncoder(LoopbackServer):
    """GET /health: healthy, with `identity` as its model_identity; POST /encode: every item answered as encoded
    (at the producer's current cache position, which the proxy's index has seen: no wait for events); with `refusal`
    (an error body's "error"), a call carrying a video item is answered 400 with it instead."""

    def __init__(self, identity: dict[str, Any] | None = None, refusal: dict[str, Any] | None = None) -> None:
        self.producer = ECProducer().start()
        self.calls: list[list[dict[str, Any]]] = []  # each /encode call's items, as sent
        self._lock = threading.Lock()
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                health = {"status": "ok", "model": "demo", "ec_address": fake.producer.address,
                          "ec_events_address": fake.producer.events_address,
                          **({"model_identity": identity} if identity is not None else {})}
                self.send_body(200, json.dumps(health).encode())

            def do_POST(self) -> None:  # noqa: N802
                items = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))["items"]
                with fake._lock:
                    fake.calls.append(items)
                if refusal is not None and any("video" in it for it in items):
                    self.send_body(400, json.dumps({"error": refusal}).encode())
                    return
                epoch, seq = fake.producer.position()
                answer = {"items": [{"mm_hash": it["mm_hash"], "num_tokens": 4} for it in items],
                          "ec_address": fake.producer.address, "ec_epoch": epoch, "ec_seq": seq}
                self.send_body(200, json.dumps(answer).encode())

        super().__init__(Handler)

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return [it for call in self.calls for it in call]

    def close(self) -> None:
        super().close()
        self.producer.close()
