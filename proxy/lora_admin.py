"""Runtime LoRA updates through the proxy, vLLM's endpoints: `POST /v1/load_lora_adapter` {"lora_name",
"lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}, behind the API key (as every /v1/ route). Each is
passed, with the internal key, to every decoder and prefill worker (each checks it: epd-decoder
--enable-lora-runtime-updating, the path inside its --allowed-lora-dir); the first refusal is the answer, as the
decoder gave it. Every worker is probed again at once, so requests for a loaded adapter route to it from the next
request on (and one just unloaded goes nowhere)."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from epd_common.errors import APIError
from proxy.state import proxy_state
from proxy.workers import GENERATORS

router = APIRouter()


async def _fan_out(request: Request, path: str) -> Response:
    fleet = proxy_state(request).fleet
    body = await request.body()
    workers = [w for role in GENERATORS for w in fleet.workers.healthy(role)]
    if not workers:
        raise APIError(503, "no healthy decoder to update", code="decoder_unavailable")
    headers = {**fleet.internal_headers, "content-type": "application/json"}

    async def one(url: str) -> httpx.Response:
        return await fleet.client.post(f"{url}{path}", content=body, headers=headers, timeout=fleet.cfg.worker_timeout)

    answers = await asyncio.gather(*(one(w.url) for w in workers), return_exceptions=True)
    await asyncio.gather(*(fleet.workers.probe(w) for w in workers), return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException):
            raise APIError(502, f"a decoder did not answer {path}: {type(answer).__name__}", code="decoder_error")
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json")
    done: dict[str, Any] = answers[0].json()  # type: ignore[union-attr]
    return JSONResponse({**done, "workers": len(workers)})


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    return await _fan_out(request, "/v1/load_lora_adapter")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    return await _fan_out(request, "/v1/unload_lora_adapter")
