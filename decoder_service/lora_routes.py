"""Runtime LoRA updates on the decoder, vLLM's endpoints and bodies: `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}. Only with
--enable-lora-runtime-updating (otherwise a 404), behind the internal key (as /generate). A load reads and checks the
adapter on a worker thread (the engine keeps stepping) and refuses what a start would refuse, as a 400 naming it;
an unload stops new requests for the adapter at once, and its weights go when the streams using it end."""
from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Request

from decoder_service.lora import load_at_runtime
from decoder_service.lora_defaults import is_reserved
from epd_common.errors import APIError, bad_request
from epd_common.lora_flags import MAX_NAME_CHARS
from epd_contracts.validation import ContractError, decode_json
from epd_models.lora.peft_format import LoRAError
from epd_models.torch_threads import setup_off_loop

router = APIRouter()
PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadLoRA(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class UnloadLoRA(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    lora_int_id: int | None = None  # vLLM's body may carry it; names are what EPD keys adapters by


async def _body(request: Request, kind: type[Any]) -> tuple[Any, Any]:
    """The decoder's state (404 unless runtime updates are on) and the checked body."""
    state = request.app.state.decoder
    if not (state.cfg.enable_lora and state.cfg.enable_lora_runtime_updating):
        raise APIError(404, "runtime LoRA updates are off (epd-decoder --enable-lora-runtime-updating)",
                       code="not_found")
    try:
        return state, decode_json(await request.body(), kind)
    except ContractError as exc:
        raise bad_request(exc.message, exc.param, code="invalid_request") from None


@router.post(PATHS[0])
async def load_lora_adapter(request: Request) -> dict[str, str]:
    state, body = await _body(request, LoadLoRA)
    engine = state.ready_engine()
    try:
        await setup_off_loop(functools.partial(load_at_runtime, engine.lm, state.cfg, body.lora_name, body.lora_path))
    except LoRAError as exc:
        raise bad_request(str(exc), "lora_path", code="invalid_lora") from None
    return {"status": "ok", "message": f"adapter {body.lora_name!r} loaded"}


@router.post(PATHS[1])
async def unload_lora_adapter(request: Request) -> dict[str, str]:
    state, body = await _body(request, UnloadLoRA)
    lora = state.ready_engine().lm.lora
    try:
        if is_reserved(body.lora_name):  # the checkpoint's modality adapters stay (decoder_service/lora_defaults.py)
            raise KeyError(body.lora_name)
        lora.remove(body.lora_name)
    except KeyError:
        raise bad_request(f"adapter {body.lora_name!r} is not loaded", "lora_name", code="invalid_lora") from None
    return {"status": "ok", "message": f"adapter {body.lora_name!r} unloaded"}
