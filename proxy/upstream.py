"""What a worker's failed or refused call becomes: its own error kept (a 4xx stays a 4xx), a failure the work is
retried elsewhere after, an encoder's "busy", an item an encoder refused; and the error a request gets when its
items found no encoder after failovers."""
from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import msgspec

from epd_common.errors import APIError
from proxy.decoder_http import DecoderResponse


def upstream_error(resp: httpx.Response | DecoderResponse, body: bytes, who: str) -> APIError:
    """Keep the worker's status and message (a 4xx stays a 4xx); unreadable bodies become 502."""
    try:
        err = json.loads(body)["error"]
        return APIError(resp.status_code, str(err.get("message")), param=err.get("param"), code=err.get("code"),
                        extra={"missing": err["missing"]} if "missing" in err else None)
    except (ValueError, KeyError, TypeError):
        return APIError(502, f"{who} answered {resp.status_code}", code="upstream_error")


class ItemRefused(APIError):
    """An encoder's 4xx about an item of its call, naming the item by the call's own field (`items.N...`):
    `mm_hash` says which, so the request's error can name the client's field instead (PreparedChat.named)."""

    def __init__(self, err: APIError, mm_hash: str):
        super().__init__(err.status, err.message, param=err.param, code=err.code, extra=err.extra)
        self.mm_hash = mm_hash


class EncoderBusy(Exception):
    """An encoder refused a call as busy (503 encoder_busy): not down, not failed; try another, or later."""

    def __init__(self, retry_after: float):
        super().__init__(f"busy; retry after {retry_after:g} s")
        self.retry_after = retry_after


class WorkerFailed(Exception):
    """A worker could not do the call: the work may be retried elsewhere. `answer` is set when the worker
    answered (a 5xx about this request): it stays in service, the work is retried once on another worker,
    and if that fails too the request ends with this error, so one poison request cannot take the fleet
    out. Without `answer` it was a transport failure (refused, reset, timeout) and the worker is marked down."""

    def __init__(self, reason: str, answer: APIError | None = None):
        super().__init__(reason)
        self.answer = answer


@dataclass(frozen=True)
class Failure:
    encoder: str  # name of the encoder that failed some items
    error: WorkerFailed


def failover_error(err: APIError, failures: tuple[Failure, ...]) -> APIError:
    """The error a request gets when its items found no encoder after `failures`, latest last: an encoder's
    5xx answer wins over "no encoder left"; transport failures are named in the message."""
    for failure in reversed(failures):
        if failure.error.answer is not None:  # it answered: the request ends with an answer, its own or the retry's
            return failure.error.answer if err.code == "encoder_unavailable" else err
        err = APIError(err.status, f"{err.message} (after encoder {failure.encoder} failed: {failure.error})",
                       param=err.param, code=err.code)
    return err


_MAX_RETRY_AFTER_S = 5.0  # an encoder's Retry-After is honoured up to this (the proxy's own deadline bounds the rest)


def error_code(body: bytes) -> object:
    try:
        return msgspec.json.decode(body).get("error", {}).get("code")
    except (msgspec.MsgspecError, AttributeError):
        return None


def retry_after(value: str | None) -> float:
    """Retry-After in seconds (its delay form), within (0, 5]; 1 when absent or not a number."""
    try:
        seconds = float(value if value is not None else 1.0)
    except ValueError:
        return 1.0
    return min(max(seconds, 0.05), _MAX_RETRY_AFTER_S) if seconds == seconds else 1.0
