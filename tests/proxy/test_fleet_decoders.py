"""Fleet with decoders that answer over real loopback HTTP: a 5xx answer is retried once elsewhere and fails its
own request alone (proxy/decoder_http.py carries /generate, so these decoders are real servers)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from epd_common.errors import APIError
from proxy.config import ProxyConfig
from proxy.fleet import Fleet
from proxy.metrics import ProxyMetrics
from tests.loopback_http import LoopbackServer, QuietHandler


def test_a_decoder_5xx_answer_is_retried_once_then_the_request_fails_alone_and_no_decoder_is_marked_down() -> None:
    from epd_contracts.sampling import SamplingParams
    from proxy.generation import Generation
    from proxy.prepare import PreparedChat

    generates: list[int] = []

    class Decoder(QuietHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn answers

        def do_GET(self) -> None:
            self.send_body(200, json.dumps({"status": "ok"}).encode())

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            generates.append(self.server.server_address[1])
            error = {"error": {"message": "engine failed this request", "code": "engine_error"}}
            self.send_body(500, json.dumps(error).encode())

    servers = [LoopbackServer(Decoder) for _ in range(3)]

    async def main() -> tuple[APIError, list[bool]]:
        cfg = ProxyConfig(encode_urls=(), decode_urls=(), dynamic_registration=True, internal_key="k")
        async with httpx.AsyncClient() as client:
            fleet = Fleet(cfg, client, ProxyMetrics(CollectorRegistry()))
            try:
                for server in servers:
                    await fleet.register("decoder", server.url)
                gen = Generation(fleet, PreparedChat(messages=[{"role": "user", "content": "hi"}], items=[], sampling=SamplingParams()), "rid")
                with pytest.raises(APIError) as err:
                    await gen.open({})
                await gen.close()
                return err.value, [w.healthy and w.load == 0 for w in fleet.workers.of("decoder")]
            finally:
                await fleet.close()

    try:
        err, fine = asyncio.run(main())
    finally:
        for server in servers:
            server.close()
    assert (err.status, err.code) == (500, "engine_error") and len(generates) == 2 and fine == [True] * 3
    assert len(set(generates)) == 2  # retried on another decoder, not the same one
