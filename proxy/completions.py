"""POST /v1/completions: OpenAI's legacy text completions (aiperf and older clients ask for it).

One prompt per request (a string, token ids, or a list holding one of either), no images; it goes to the decoder
as GenerateRequest(prompt=..., echo=...), tokenized there as is (no chat template). `max_tokens` defaults to 16 as
OpenAI's does. `logprobs` (0..5) is the legacy shape ({tokens, token_logprobs, top_logprobs, text_offset}); echo
with logprobs would need the prompt's logprobs, which are not computed: a 400, as are `suffix` and `best_of` > 1.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import ConfigDict, Field

from epd_common.errors import APIError, bad_request
from epd_common.http import until_disconnected
from epd_common.logs import request_id_var
from epd_contracts.generate import MAX_PROMPT_TOKEN_IDS, Event
from epd_contracts.limits import MAX_MODEL_NAME_CHARS
from epd_contracts.sampling import MAX_N
from proxy.choices import Choices, check_n, legacy_logprobs
from proxy.generation import Generation
from proxy.prefix_keys import prefix_secret, prompt_keys
from proxy.prepare import PreparedChat, check_model
from proxy.protocol import CacheSalt, StreamOptions
from proxy.sampling_fields import contract_sampling, not_sampling, refuse
from proxy.state import ProxyState, proxy_state
from proxy.streaming import respond
from proxy.surrogates import SurrogateFree
from proxy.unsupported import unsupported_parameter

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_LOGPROBS = 5  # OpenAI's limit on the legacy logprobs
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


class CompletionRequest(SurrogateFree):
    # other fields: sampling (the contract checks them) or refused by proxy.unsupported (suffix, best_of, ...)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(max_length=MAX_MODEL_NAME_CHARS)
    prompt: str | TokenIds | list[str] | list[TokenIds]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    cache_salt: CacheSalt = None

    def one_prompt(self) -> str | list[int]:
        """The prompt; a list of several prompts is refused (one generation per request here)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: {len(prompt)} prompts in one request; this server takes one per "
                               "request (send them as separate requests)", param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt", code="invalid_request")
        return prompt  # type: ignore[return-value]  # a list here holds token ids only

    def prepare(self, secret: bytes = b"") -> PreparedChat:
        """The decoder's request (`secret`: its prefix key's, proxy.prefix_keys); a 400 naming the first field it
        cannot serve."""
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo: echo with logprobs needs the prompt's logprobs, which this server does not "
                           "compute", param="echo", code="unsupported_parameter")
        sampling = contract_sampling(self.model_extra or {}, self.n, self.logprobs, DEFAULT_MAX_TOKENS)
        refuse(unsupported_parameter(not_sampling(self.model_extra or {})))
        prompt, salt = self.one_prompt(), self.cache_salt or ""
        return PreparedChat(messages=[], items=[], sampling=sampling, prompt=prompt, echo=bool(self.echo),
                            cache_salt=salt, prefix_keys=prompt_keys(prompt, salt, secret))


@dataclass
class TextCompletion:
    """One text answer's objects; streamed chunks have the same shape as the whole answer (as OpenAI's)."""

    model: str
    logprobs: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> text_offset of its next token (streaming)

    def _object(self, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, **more}

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return []  # no role to announce

    def delta_chunk(self, ev: Event) -> dict[str, Any] | None:
        if not ev.text and not ev.logprobs:
            return None
        logprobs = None
        if self.logprobs:
            entries = ev.logprobs or []
            logprobs = legacy_logprobs(entries, self.offsets.get(ev.index, 0))
            self.offsets[ev.index] = self.offsets.get(ev.index, 0) + sum(len(e.token) for e in entries)
        return self._object([{"text": ev.text, "index": ev.index, "logprobs": logprobs, "finish_reason": None}])

    def finish_chunk(self, ev: Event) -> dict[str, Any]:
        """The choice's last chunk, with the logprobs of tokens that ended with no text (a held-back last token)."""
        logprobs = None
        if self.logprobs and ev.logprobs:
            logprobs = legacy_logprobs(ev.logprobs, self.offsets.get(ev.index, 0))
        return self._object([{"text": "", "index": ev.index, "logprobs": logprobs,
                              "finish_reason": _finish_reason(ev.finish_reason)}])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._object([], usage=usage)

    def response(self, choices: Choices) -> dict[str, Any]:
        return self._object([{"text": "".join(c.text), "index": c.index,
                              "logprobs": legacy_logprobs(c.logprobs, 0) if self.logprobs else None,
                              "finish_reason": _finish_reason(c.finish_reason)} for c in choices.in_order()],
                            usage=choices.usage())


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> Response:
    # as chat: a client that leaves before its answer is out stops the generation
    answer = await until_disconnected(request.receive, _answer(proxy_state(request), req))
    return Response(status_code=499) if answer is None else answer


async def _answer(state: ProxyState, req: CompletionRequest) -> Response:
    start = time.perf_counter()
    fleet = state.fleet
    served = fleet.served_model_name()
    lora = check_model(req.model, served, fleet.workers.loras())
    check_n(req.n, fleet.workers.of("decoder"))
    prepared = dataclasses.replace(req.prepare(prefix_secret(state.cfg.internal_key)), lora=lora)
    gen = Generation(fleet, prepared, request_id_var.get())
    await gen.start()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    answer = TextCompletion(model=lora or served or req.model, logprobs=req.logprobs is not None)
    return await respond(gen, answer, req.stream, include_usage, state.metrics, start, prepared.sampling.n)
