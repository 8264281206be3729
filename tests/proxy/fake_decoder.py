"""A fake decoder on loopback that speaks the /generate NDJSON contract: its answers are computed from the request
(n choices interleaved, logprobs when asked, a tool call when tools may be called), so tests derive what the proxy
must return from the same `script`, never from hard-coded outputs."""
from __future__ import annotations

import json
from typing import Any

from tests.loopback_http import LoopbackServer, QuietHandler

IDENTITY = {"family": "llava", "fingerprint": "0123456789abcdef", "hidden_size": 64}
PROMPT_TOKENS = 7


def words(index: int) -> list[str]:
    """Choice `index`'s tokens (distinct per choice, with a multi-byte character)."""
    return [f"c{index}", " é", "!"]


def entry(token: str, k: int) -> dict[str, Any]:
    """A TokenLogprob whose alternatives are the token itself and k - 1 made-up ones, most likely first."""
    top = [{"token": token if j == 0 else f"alt{j}", "logprob": -0.5 * j, "bytes": list((token if j == 0 else
            f"alt{j}").encode())} for j in range(k)]
    return {"token": token, "logprob": 0.0, "bytes": list(token.encode()), "top_logprobs": top}


def script(body: dict[str, Any], cached_tokens: int = 0) -> list[dict[str, Any]]:
    sampling = body.get("sampling", {})
    n, k = sampling.get("n", 1), sampling.get("logprobs")
    calls = bool(body.get("tools")) and body.get("tool_choice", {}).get("mode", "auto") != "none"
    events: list[dict[str, Any]] = []
    if body.get("echo"):
        events += [{"type": "delta", "index": i, "text": str(body["prompt"])} for i in range(n)]
    for step in range(3):
        for i in range(n):
            if calls:
                name = body["tools"][0]["function"]["name"]
                piece = [{"index": 0, "id": f"call_{i}", "name": name, "arguments": ""},
                         {"index": 0, "arguments": '{"city": '}, {"index": 0, "arguments": f'"P{i}"}}'}][step]
                events.append({"type": "delta", "index": i, "tool_calls": [piece]})
                continue
            token = words(i)[step]
            ev: dict[str, Any] = {"type": "delta", "index": i, "text": token}
            if k is not None and step < 2:
                ev["logprobs"] = [entry(token, k)]
            events.append(ev)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3, "total_tokens": PROMPT_TOKENS + 3,
             "cached_tokens": cached_tokens}
    reason = "tool_calls" if calls else "length"
    for i in range(n):  # as the decoder does for a last token whose text came with the flush: its logprobs in `done`
        last = [entry(words(i)[2], k)] if k is not None and not calls else None
        events.append({"type": "done", "index": i, "finish_reason": reason, "usage": usage,
                       **({"logprobs": last} if last else {})})
    return events


class FakeDecoder(LoopbackServer):
    """GET /health: a healthy decoder serving "demo"; POST /generate: `script`'s events as NDJSON.

    With `held` (a list, not None) it keeps a prefix cache, as the real decoder reports it: /health's
    prefix_cache.keys are `held`, to which each request's prefix_keys are added once it is answered. `identity`:
    its model_identity (default IDENTITY, a model without video); `health`: more /health fields (max_model_len)."""

    def __init__(self, cached_tokens: int = 0, held: list[str] | None = None,
                 identity: dict[str, Any] | None = None, health: dict[str, Any] | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.cached_tokens, self.held = cached_tokens, held
        fake, more = self, health

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                health = {"status": "ok", "model": "demo", "model_identity": identity or IDENTITY, **(more or {})}
                if fake.held is not None:
                    health["prefix_cache"] = {"enabled": True, "block_size": 16, "keys": list(fake.held)}
                self.send_body(200, json.dumps(health).encode())

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                fake.bodies.append(body)
                if fake.held is not None:
                    fake.held.extend(body.get("prefix_keys", []))
                lines = "".join(json.dumps(ev) + "\n" for ev in script(body, fake.cached_tokens))
                self.send_body(200, lines.encode(), "application/x-ndjson")

        super().__init__(Handler)
