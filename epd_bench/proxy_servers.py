"""The two servers `python -m epd_bench.proxy` puts around the proxy: a fake decoder that answers instantly, and a
pass-through proxy with no logic (the practical limit).

    python -m epd_bench.proxy_servers fake-decoder [--port P]
    python -m epd_bench.proxy_servers passthrough --decoder-url URL --port P

The fake decoder speaks the part of the decoder's internal API the proxy uses (GET /health with `model` and
`model_identity`, as the fleet probes; POST /generate answered with NDJSON `delta`/`done` events) on plain asyncio
streams with keep-alive, so what the bench measures is the proxy in front of it, not this server. The pass-through is
uvicorn with one raw ASGI app and one httpx client kept alive to the decoder: POST /v1/chat/completions is forwarded
to /generate and its bytes streamed back unchanged; anything else is a 404.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from epd_bench.micro import parser

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


def make_app(decoder_url: str) -> Any:
    """A raw ASGI app forwarding chat completions to `decoder_url`/generate (the client opens at first use)."""
    client: list[httpx.AsyncClient] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    client.append(httpx.AsyncClient(base_url=decoder_url, timeout=30.0))
                    await send({"type": "lifespan.startup.complete"})
            await client[0].aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = client[0].build_request("POST", "/generate", content=body)
        resp = await client[0].send(request, stream=True)
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(b"content-type", b"text/event-stream")]})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()

    return app


async def _serve_fake(host: str, port: int) -> None:
    fake = FakeDecoder(host, port)
    await fake.start()
    print(fake.url, flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    p = parser("proxy_servers", __doc__, json_help=None)
    p.add_argument("server", choices=("fake-decoder", "passthrough"))
    p.add_argument("--decoder-url", help="passthrough: the decoder it forwards to")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    if args.server == "fake-decoder":
        asyncio.run(_serve_fake(args.host, args.port))
    elif args.decoder_url is None:
        p.error("passthrough needs --decoder-url")
    else:
        import uvicorn

        uvicorn.run(make_app(args.decoder_url), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
