"""The practical limit for `epd_bench.proxy`: a pass-through proxy with no logic (uvicorn, one raw ASGI app, one
httpx client kept alive to one decoder). POST /v1/chat/completions is forwarded to the decoder's /generate and its
bytes are streamed back unchanged; anything else is a 404. What the real proxy adds over this is its own cost."""
from __future__ import annotations

import argparse
from typing import Any

import httpx
import uvicorn


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A pass-through proxy with no logic, in front of one decoder.")
    parser.add_argument("--decoder-url", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(make_app(args.decoder_url), host=args.host, port=args.port, log_level="warning", access_log=False)
