"""A fake decoder that answers instantly, for `epd_bench.proxy`: it speaks the part of the real decoder's internal
API the proxy uses (GET /health with `model` and `model_identity`, as the fleet probes; POST /generate answered
with NDJSON `delta`/`done` events), on plain asyncio streams with keep-alive, so that what the bench measures is
the proxy in front of it, not this server (no framework, no per-request parsing beyond the HTTP head)."""
from __future__ import annotations

import argparse
import asyncio
import json

IDENTITY = {"family": "llava", "fingerprint": "fa4edec0de000000", "hidden_size": 64}
TOKENS = ("Hello", " there", "!")


def generate_body(tokens: tuple[str, ...] = TOKENS) -> bytes:
    """The NDJSON answer to every /generate: one delta per token, then `done` with usage (a one-choice reply)."""
    events: list[dict[str, object]] = [{"type": "delta", "index": 0, "text": t} for t in tokens]
    usage = {"prompt_tokens": 12, "completion_tokens": len(tokens), "total_tokens": 12 + len(tokens),
             "cached_tokens": 0}
    events.append({"type": "done", "index": 0, "finish_reason": "stop", "usage": usage})
    return "".join(json.dumps(ev) + "\n" for ev in events).encode()


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class FakeDecoder:
    """Serves on `host:port` (0: a free port, read `port` after `start`); counts the /generate calls it answered."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model: str = "demo") -> None:
        self.host, self.port = host, port
        self.generated = 0
        self._health = _response("200 OK", "application/json",
                                 json.dumps({"status": "ok", "model": model, "model_identity": IDENTITY}).encode())
        self._generate = _response("200 OK", "application/x-ndjson", generate_body())
        self._not_found = _response("404 Not Found", "application/json", b'{"detail": "not found"}')
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One keep-alive connection: read a head (and its body, by content-length), answer, repeat until EOF."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ", 2)[:2]
                length = 0
                for line in lines[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                if method == b"POST" and path == b"/generate":
                    self.generated += 1
                    writer.write(self._generate)
                elif method == b"GET" and path == b"/health":
                    writer.write(self._health)
                else:
                    writer.write(self._not_found)
                await writer.drain()
        finally:
            writer.close()


async def _main(host: str, port: int) -> None:
    fake = FakeDecoder(host, port)
    await fake.start()
    print(fake.url, flush=True)  # the bench reads the URL from the first line
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A fake decoder answering /health and /generate instantly.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(_main(args.host, args.port))
