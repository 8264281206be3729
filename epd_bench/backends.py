"""epd-bench's request functions: one streaming request, timed token by token.

- `openai-chat`: POST {base}/v1/chat/completions with `stream: true` (any OpenAI-compatible server);
  SSE `data:` lines, `[DONE]` optional (transformers serve just ends the body).
- `epd-decoder`: POST {base}/generate straight to an EPD decoder (NDJSON events, its internal API), so
  the proxy's own cost can be measured as the difference. Images go inline (`data`), which only an
  `--aggregated` decoder accepts; text-only requests work with any decoder; videos and audio are not sent
  this way (the proxy plans a video's frames and a clip's chunks; epd-bench refuses the combination).

TTFT is the time to the first chunk carrying generated text: the proxy sends an empty role chunk
before generation starts, and counting that (as vLLM's client does) would time nothing. A request is
its sample's system message, then `history` (earlier turns of a multi-turn conversation), then the
sample's own user turn (videos as `video_url` parts, with `mm_processor_kwargs.num_frames` asking for every frame
of the clip, then audio clips as OpenAI's `input_audio` parts, base64 WAV); the answer's usage gives prompt, output and cached prompt tokens.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from epd_bench.dataset import SampleRequest


@dataclass(frozen=True)
class RequestInput:
    url: str
    model: str
    sample: SampleRequest
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    history: tuple[dict[str, Any], ...] = ()  # OpenAI messages between the system message and this turn


@dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    prompt_tokens: int = 0  # from the server's usage; 0 when it reports none
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens the server reused
    turn: int = 1  # 1-based turn of its conversation (1 outside the multi-turn workload)
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    latency: float = 0.0  # seconds, request sent -> last byte
    start_time: float = 0.0  # seconds since the benchmark started (set by the runner)
    error: str = ""


class _Timer:
    """Turns text chunks into TTFT and ITL as they arrive."""

    def __init__(self, out: RequestOutput):
        self.out, self.start = out, time.perf_counter()
        self.last = self.start
        self.chunks = 0

    def text(self, piece: str) -> None:
        if not piece:
            return
        now = time.perf_counter()
        if self.chunks == 0:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.last, self.chunks = now, self.chunks + 1
        self.out.generated_text += piece

    def done(self, usage: dict[str, Any] | None) -> None:
        self.out.latency = time.perf_counter() - self.start
        self.out.prompt_tokens = int((usage or {}).get("prompt_tokens", 0))
        self.out.output_tokens = int((usage or {}).get("completion_tokens", 0)) or self.chunks
        details = (usage or {}).get("prompt_tokens_details") or {}  # OpenAI's place; the decoder's is top level
        self.out.cached_tokens = int(details.get("cached_tokens", (usage or {}).get("cached_tokens", 0)) or 0)
        self.out.success = self.out.output_tokens > 0
        if self.chunks == 0:  # tokens but no visible text (e.g. all special): the answer came at the end
            self.out.ttft = self.out.latency
        if not self.out.success:
            self.out.error = "no output tokens"


def _headers(inp: RequestInput) -> dict[str, str]:
    return {"Authorization": f"Bearer {inp.api_key}"} if inp.api_key else {}


def user_message(sample: SampleRequest) -> dict[str, Any]:
    """The sample's user turn: its images, its videos (`video_url` parts, the form vLLM takes), its audio clips
    (`input_audio` parts, OpenAI's form), then its text."""
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in sample.images]
    content += [{"type": "video_url", "video_url": {"url": u}} for u in sample.videos]
    content += [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}} for b64 in sample.audios]
    content.append({"type": "text", "text": sample.prompt})
    return {"role": "user", "content": content}


def _video_kwargs(sample: SampleRequest) -> dict[str, Any]:
    """`mm_processor_kwargs.num_frames` when the request carries a video (here or in its history): every frame of
    the clip (vLLM's and EPD's request-level field; --extra-body can replace it)."""
    return {"mm_processor_kwargs": {"num_frames": sample.video_frames}} if sample.video_frames else {}


def chat_messages(inp: RequestInput) -> list[dict[str, Any]]:
    system = [{"role": "system", "content": inp.sample.system}] if inp.sample.system else []
    return [*system, *inp.history, user_message(inp.sample)]


def _chat_body(inp: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": inp.model, "messages": chat_messages(inp), "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": inp.sample.output_len,
        "temperature": inp.temperature,
    }
    if inp.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **_video_kwargs(inp.sample), **inp.extra_body}


async def _post_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], inp: RequestInput,
                       read: Callable[[AsyncIterator[str], _Timer], Awaitable[None]]) -> RequestOutput:
    """POST `body` and hand the streamed lines to `read`; a non-200 answer or a transport error becomes out.error.

    The clock starts before the request is sent, so TTFT includes connecting and the server's queueing."""
    out = RequestOutput()
    timer = _Timer(out)
    try:
        async with client.stream("POST", url, json=body, headers=_headers(inp)) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            await read(resp.aiter_lines(), timer)
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _read_sse(lines: AsyncIterator[str], timer: _Timer) -> None:
    out, usage = timer.out, None
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            out.error = str(obj["error"].get("message", obj["error"]))
            return
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            timer.text((delta.get("content") or "") + (delta.get("reasoning_content") or ""))
        usage = obj.get("usage") or usage
    timer.done(usage)


async def openai_chat(client: httpx.AsyncClient, inp: RequestInput) -> RequestOutput:
    return await _post_stream(client, f"{inp.url}/v1/chat/completions", _chat_body(inp), inp, _read_sse)


def _decoder_body(inp: RequestInput) -> dict[str, Any]:
    """The chat messages with every image part replaced by {"type": "image"} and its bytes sent inline.
    ValueError for a video or an audio clip (a decoder takes one only as the proxy plans it; epd-bench refuses the
    flags)."""
    images: list[dict[str, Any]] = []

    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p["type"] == "video_url":
            raise ValueError("the epd-decoder backend sends no videos")
        if p["type"] == "input_audio":
            raise ValueError("the epd-decoder backend sends no audio")
        if p["type"] != "image_url":
            return p
        b64 = p["image_url"]["url"].split(",", 1)[1]
        images.append({"mm_hash": hashlib.sha256(b64.encode()).hexdigest(), "data": b64})
        return {"type": "image"}

    messages = [m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
                for m in chat_messages(inp)]
    sampling = {"max_tokens": inp.sample.output_len, "temperature": inp.temperature, "ignore_eos": inp.ignore_eos,
                **inp.extra_body}  # the decoder's sampling contract (epd_contracts.sampling)
    return {"messages": messages, "images": images, "sampling": sampling}


async def _read_ndjson(lines: AsyncIterator[str], timer: _Timer) -> None:
    out = timer.out
    async for line in lines:
        if not line:
            continue
        event = json.loads(line)
        if event["type"] == "delta":
            timer.text(event.get("text", ""))
        elif event["type"] == "done":
            timer.done(event.get("usage"))
            return
        else:
            out.error = str(event.get("message", "generation failed"))
            return
    out.error = "stream ended without done"


async def epd_decoder(client: httpx.AsyncClient, inp: RequestInput) -> RequestOutput:
    return await _post_stream(client, f"{inp.url}/generate", _decoder_body(inp), inp, _read_ndjson)


RequestFunc = Callable[[httpx.AsyncClient, RequestInput], Any]
BACKENDS: dict[str, RequestFunc] = {"openai-chat": openai_chat, "epd-decoder": epd_decoder}
