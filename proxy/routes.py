"""The proxy's routes, each reading the shared ProxyState from `request.app.state.proxy`."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from epd_common.errors import APIError
from epd_common.http import has_bearer, is_internal, until_disconnected
from epd_common.logs import request_id_var
from proxy.choices import check_n
from proxy.completions import router as completions_router
from proxy.fleet import Fleet
from proxy.generation import Generation
from proxy.openai_format import Completion
from proxy.prepare import check_model, under_vision_adapter
from proxy.protocol import ChatCompletionRequest, InstanceRequest
from proxy.state import ProxyState, proxy_state
from proxy.streaming import respond
from proxy.workers import ROLES, ModelMismatch

logger = logging.getLogger("epd.proxy")
router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    # a client that leaves before its answer is out (prepare, encode, a non-streaming generation) stops it:
    # no generation is opened, or the one opened is closed, which cancels it on the decoder
    answer = await until_disconnected(request.receive, _answer_chat(proxy_state(request), req))
    if answer is None:
        logger.info("client went away before its answer: stopped")
        return Response(status_code=499)  # nobody reads it; counted in epd_proxy_requests
    return answer


async def _answer_chat(state: ProxyState, req: ChatCompletionRequest) -> Response:
    start = time.perf_counter()
    fleet = state.fleet
    served = fleet.served_model_name()
    lora = check_model(req.model, served, fleet.workers.loras())
    check_n(req.n, fleet.workers.of("decoder"))
    chat = dataclasses.replace(await state.prepare(req), lora=lora)
    if lora and lora in fleet.workers.vision_loras():
        chat = under_vision_adapter(chat, lora)
    gen = Generation(fleet, chat, request_id_var.get())
    await gen.start()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    answer = Completion(model=lora or served or req.model, logprobs=chat.sampling.logprobs is not None)
    return await respond(gen, answer, req.stream, include_usage, state.metrics, start, chat.sampling.n)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The served model, then the LoRA adapters the decoders serve (each with its `parent`, as vLLM lists them)."""
    fleet = proxy_state(request).fleet
    served = fleet.served_model_name()
    if not served:
        return {"object": "list", "data": []}
    return {"object": "list", "data": [_card(served)] + [_card(n, served) for n in sorted(fleet.workers.loras())]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    """The served model's or an adapter's card; any other id is OpenAI's 404 `model_not_found`."""
    fleet = proxy_state(request).fleet
    served = fleet.served_model_name()
    if served is not None and model_id in fleet.workers.loras() and model_id != served:
        return _card(model_id, served)
    if served is None or model_id != served:
        raise APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
    return _card(served)


def _card(name: str, parent: str | None = None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "epd", "root": name,
            **({"parent": parent} if parent else {})}


@router.get("/health")
@router.head("/health", include_in_schema=False)  # HEAD: the same status, no body
async def health(request: Request) -> dict[str, Any]:
    """Liveness: 200 while the process serves, whatever its workers do (readiness is /ready). The details (this
    process's pid, every worker's URL, health and load: what /instances guards) only with the internal key."""
    state = proxy_state(request)
    fleet = state.fleet  # 503 while starting
    if not is_internal(request.headers, state.cfg.internal_key):
        return {"status": "ok", "role": "proxy"}
    return {"status": "ok", "role": "proxy", "pid": os.getpid(), **_instances(fleet)}


@router.get("/ready")
@router.head("/ready", include_in_schema=False)  # HEAD: the same status, no body
async def ready(request: Request) -> dict[str, Any]:
    """Readiness: 503 while no healthy decoder (or, unless aggregated, no healthy encoder) can take work."""
    state = proxy_state(request)
    why = "proxy is starting" if state.started is None else \
        state.started.workers.not_ready(need_encoder=not state.cfg.aggregated)
    if why is not None:
        raise APIError(503, f"not ready: {why}", code="not_ready")
    return {"status": "ready", "role": "proxy"}


@router.get("/instances")
async def list_instances(request: Request) -> dict[str, Any]:
    """The workers with their health and load. A proxy run --insecure lists them to anyone (its internal side is
    open by choice, and a reader changes nothing); registering and removing still need the internal key."""
    state = proxy_state(request)
    return _instances(state.fleet if state.cfg.insecure else _registration(request))


@router.post("/instances", status_code=201)
async def add_instance(body: InstanceRequest, request: Request) -> dict[str, Any]:
    fleet = _registration(request)
    if fleet.cfg.aggregated and body.role == "encoder":
        raise APIError(400, "an aggregated proxy has no encoders", param="role", code="invalid_value")
    try:
        worker = await fleet.register(body.role, body.url)
    except ModelMismatch as exc:
        raise APIError(409, str(exc), param="url", code="model_mismatch") from exc
    except ValueError as exc:
        raise APIError(409, str(exc), param="url", code="conflict") from exc
    return {"role": worker.role, **worker.describe()}


@router.delete("/instances")
async def remove_instance(body: InstanceRequest, request: Request) -> dict[str, Any]:
    worker = _registration(request).deregister(body.url)
    if worker is None:
        raise APIError(404, f"no worker is registered at {body.url}", param="url", code="not_found")
    return {"role": worker.role, "url": worker.url, "removed": True}


def _registration(request: Request) -> Fleet:
    """/instances needs the internal key (not the public API key); without one configured it is off."""
    state = proxy_state(request)
    if not state.cfg.internal_key:
        raise APIError(403, "dynamic registration is off: start the proxy with --internal-key",
                       code="registration_disabled")
    if not has_bearer(request.headers, state.cfg.internal_key):
        raise APIError(401, "missing or invalid internal key: send `Authorization: Bearer <internal key>`",
                       code="invalid_internal_key")
    return state.fleet


def _instances(fleet: Fleet) -> dict[str, Any]:
    return {f"{role}s": [w.describe() for w in fleet.workers.of(role)] for role in ROLES}


router.include_router(completions_router)  # POST /v1/completions (proxy/completions.py)
