"""One request's upstream generation: opened with recovery and decoder failover, read as events, released once."""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Sequence

import httpx
import msgspec

from epd_common.errors import APIError
from epd_common.tracing import span
from epd_contracts.generate import Event, Handoff
from proxy.decoder_events import StreamEnded, decode_event, lost, next_event
from proxy.decoder_http import DecoderResponse
from proxy.fleet import Fleet
from proxy.media_kind import Placement
from proxy.prepare import PreparedChat
from proxy.upstream import ItemRefused, WorkerFailed
from proxy.worker_state import Worker, WorkerDown, until_down
from scheduler.scheduler import SchedulerOutput

logger = logging.getLogger("epd.proxy")


class Generation:
    """Decoder failures before the first token are invisible to the client: the generation is reopened on
    another decoder. After the first token a failure ends the stream with an error event.

    E -> P -> D (prefill workers configured): the generation opens on a prefill worker (by prefix affinity and load)
    with a hand-off key; its first tokens stream to the client as they come, and its `handoff` event (not sent on)
    reopens the generation on a decode worker (by load) with that hand-off, whose events continue the same stream.
    A prefill worker that fails before its first event is replaced like a decoder; with none healthy the request
    runs E + PD on a decoder. A decode worker that fails before its first event is replaced too, with the same
    hand-off (it fetches the K/V, or prefills the prompt itself when the K/V is gone). A prefill worker declines a
    short prompt before prefilling it (its one event is `declined`): the request then runs E + PD on a decoder.

    A stream opens on a prefill worker only while a decode worker is healthy to continue it. With none, a prefill
    worker (it holds the whole model) runs the request whole, without a hand-off; and a hand-off that finds no decode
    worker after all (it died since the check) continues on a prefill worker, which prefills the prompt again (its
    prefix cache holds it) and decodes on. With no worker of either role the request is a 503 before any byte."""

    def __init__(self, fleet: Fleet, chat: PreparedChat, request_id: str):
        self.fleet, self.chat, self.request_id = fleet, chat, request_id
        self.role = "prefill" if fleet.splits_prefill else "decoder"  # where the next open goes
        self.handoff_key = secrets.token_hex(16)
        self.handoff: Handoff | None = None  # the prefill worker's, once it came
        self.decoder: Worker | None = None
        self.tried: set[str] = set()  # decoders that failed this request
        self.answered: APIError | None = None  # a decoder's 5xx answer to this request (it stays in service)
        self.resp: DecoderResponse | None = None
        self.sources: dict[str, str] = {}
        self.cached: frozenset[str] = frozenset()  # items an encoder already held: not encoded for this request
        self.finished = False  # the decoder sent a `done` and no error: it holds this prompt's K/V (affinity)

    async def open(self, sources: dict[str, str], pending: frozenset[str] = frozenset(),
                   cached: frozenset[str] | None = None) -> None:
        """Open the stream on a healthy decoder (scheduler/affinity.py), moving to the next one if it fails.

        `pending` items are still being encoded: the decoder's gather waits for them (pipelined mode). `cached`
        items were skipped by the scheduler (the decoder counts their tokens as cached_tokens).
        """
        self.sources = sources
        if cached is not None:
            self.cached = cached
        while True:
            keys = self.chat.prefix_keys if self.handoff is None else ()  # a decode worker is chosen by load
            if self.role == "prefill" and not self.fleet.workers.healthy("decoder"):
                logger.warning("no decode worker is healthy to continue a hand-off; the request runs whole")
                self.role = "decoder"  # never a first token that nothing can continue
            try:
                decoder = self.decoder = self._acquire(keys)  # 503: all failed
            except APIError:
                if self.role == "prefill":  # no prefill worker can take it: E + PD on a decoder
                    logger.warning("no prefill worker available; the request prefills on a decoder")
                    self.role = "decoder"
                    continue
                if self.answered is not None:  # no other decoder: the answer is the request's own error
                    raise self.answered from None
                raise
            try:
                await self._open_on_decoder(pending)
                return
            except WorkerFailed as exc:
                logger.warning("decoder %s failed before the first token (%s); trying another", decoder.url, exc)
                self.fleet.decoder_failed(decoder, str(exc), mark_down=False)
                self.tried.add(decoder.url)
                self._release()
                if exc.answer is not None:  # a 5xx answer: retried once elsewhere, then the request fails with it
                    if self.answered is not None:
                        raise exc.answer from exc
                    self.answered = exc.answer
            except BaseException:
                self._release()
                raise
            pending = frozenset()

    def _acquire(self, keys: Sequence[str]) -> Worker:
        """A worker of the role the next open goes to. A decode worker, when none is left: a prefill worker (E -> P
        -> D only), chosen by the prompt's prefix keys (the one that prefilled it holds its K/V), which runs the
        request whole, or continues the hand-off by prefilling it again."""
        try:
            return self.fleet.acquire_decoder(self.tried, keys, self.role, self.chat.lora)
        except APIError:
            if self.role != "decoder" or not self.fleet.splits_prefill:
                raise
        logger.warning("no decode worker available; a prefill worker %s the request",
                       "runs" if self.handoff is None else "continues")
        return self.fleet.acquire_decoder(self.tried, self.chat.prefix_keys, "prefill", self.chat.lora)

    async def _open_on_decoder(self, pending: frozenset[str]) -> None:
        """A gather miss re-encodes the missing items and retries once on the same decoder."""
        assert self.decoder is not None
        for attempt in (0, 1):
            at = Placement(self.sources, pending, self.cached, self.fleet.cfg.aggregated)
            body = self.chat.request([it.decoder_ref(at) for it in self.chat.items])
            if self.role == "prefill":
                body = msgspec.structs.replace(body, handoff_key=self.handoff_key)
            elif self.handoff is not None:
                body = msgspec.structs.replace(body, handoff=self.handoff)
            try:
                self.resp = await self.fleet.open_generation(self.decoder, body, self.request_id)
                return
            except APIError as exc:
                if exc.code != "missing_embeddings":
                    raise
                if attempt:  # lost again right after re-encoding: not the client's fault, and retryable
                    raise APIError(503, f"embeddings lost twice: {exc.message}", code="embeddings_unavailable") from exc
                self.fleet.metrics.retries.inc()
                missing = set(exc.extra.get("missing", []))
                logger.warning("decoder missed %d embedding(s); re-encoding", len(missing))
                redo = [it for it in self.chat.encodes if it.mm_hash in missing]  # a video's lost chunks
                self.cached -= missing  # encoded again for this request
                self.sources = {**self.sources, **await self.fleet.encode(redo, self.request_id, skip_cached=False)}
                pending = frozenset()

    async def start(self) -> None:
        """Encode, then open the decoder stream (pipelined: both at once); on any failure the generation is closed."""
        cfg = self.fleet.cfg
        try:
            if cfg.pipeline_encode and not cfg.aggregated:
                await self.open_pipelined()
            else:
                await self.open_encoded()
        except ItemRefused as exc:  # an encoder refused an item: the error names the client's field of it
            await self.close()
            raise self.chat.named(exc, exc.mm_hash) from exc
        except BaseException:
            await self.close()
            raise

    async def open_encoded(self) -> None:
        """Encode every item first (the scheduler skips those held already), then open the decoder stream."""
        plan = self.fleet.plan(self.chat.encodes)
        await self.open(await self._encode(plan), cached=frozenset(plan.skipped))

    async def _encode(self, plan: SchedulerOutput) -> dict[str, str]:
        """The plan's encodes, traced as `encode` (the encoders' /encode spans are its children)."""
        with span("encode", {"epd.items.skipped": len(plan.skipped), "epd.items.joined": len(plan.joined),
                             "epd.items.sent": plan.num_scheduled, "epd.encoders": len(plan.scheduled_encoder_inputs)}):
            return await self.fleet.execute(plan, self.request_id)

    async def open_pipelined(self) -> None:
        """Schedule the encodes, then open the decoder stream while they run; an encode error wins. If an
        encoder fails over, the stream (waiting on the dead encoder) is reopened with the new sources."""
        plan = self.fleet.plan(self.chat.encodes)
        encodes = asyncio.create_task(self._encode(plan))
        opening = asyncio.create_task(self.open(plan.sources, plan.pending, frozenset(plan.skipped)))
        try:
            sources = await encodes
        except BaseException:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            raise
        if sources == plan.sources:
            await opening
            return
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await self.close_stream()
        await self.open(sources)

    async def events(self) -> AsyncIterator[Event]:
        """The decoder's events; before the first token a lost decoder means a retry on another one."""
        while True:
            assert self.resp is not None and self.decoder is not None
            lines = self.resp.aiter_lines()
            try:
                first = await until_down(next_event(lines), self.decoder)
            except (httpx.HTTPError, WorkerDown, StreamEnded) as exc:
                if not await self._reopen(f"stream lost before the first token: {type(exc).__name__}"):
                    yield lost(exc)
                    return
                continue
            if first.type in ("handoff", "declined"):
                if (error := await (self._hand_over(first) if first.type == "handoff" else self._declined(first))):
                    yield self._seen(error)
                    return
                continue
            yield self._seen(first)
            handed: Event | None = None
            try:
                async for line in lines:
                    if line:
                        event = decode_event(line)
                        if event.type == "handoff":
                            handed = event
                            break
                        if event.type == "declined":  # only ever a prefill worker's first and only event
                            event = Event(type="error", message="a decoder declined a hand-off after its first tokens")
                        yield self._seen(event)
            except httpx.HTTPError as exc:
                yield self._seen(lost(exc))
            if handed is None:
                return
            if (error := await self._hand_over(handed)) is not None:
                yield self._seen(error)
                return

    async def _hand_over(self, event: Event) -> Event | None:
        """The prefill worker's `handoff`: the generation continues on a decode worker with it; an error event
        when none can take it (the stream then ends after the first tokens already sent)."""
        if event.handoff is None or self.role != "prefill":
            return Event(type="error", message="a decoder sent a hand-off this request did not ask for")
        self.fleet.metrics.handoffs.inc()
        self.handoff, self.tried = event.handoff, set()
        self.finished = True  # the prefill worker holds the prompt's K/V in its prefix cache now
        return await self._to_decoder("continue")

    async def _declined(self, event: Event) -> Event | None:
        """The prefill worker declined the hand-off (a short prompt: its --handoff-min-tokens): the request runs on a
        decode worker, which prefills it (E + PD); an error event when none can take it."""
        if self.role != "prefill":
            return Event(type="error", message="a decoder declined a hand-off this request did not ask for")
        self.fleet.metrics.handoffs_declined.inc()
        logger.debug("prefill worker declined the hand-off: %s", event.message)
        return await self._to_decoder("take")

    async def _to_decoder(self, verb: str) -> Event | None:
        """Leave the prefill worker and open the generation on a decode worker; an error event when none can
        `verb` the request."""
        self.role = "decoder"
        await self.close_stream()
        self._release()
        try:
            await self.open(self.sources)
        except APIError as exc:
            logger.warning("no decode worker could %s the request: %s", verb, exc.message)
            return Event(type="error", message=f"no decode worker could {verb} the request: {exc.message}")
        return None

    def _seen(self, event: Event) -> Event:
        if event.type != "delta":  # an error is the stream's last event: it undoes an earlier choice's `done`
            self.finished = event.type == "done"
        if event.type == "done" and event.usage is not None and self.handoff is not None:
            # a continued choice: what was reused of the prompt is the prefill's (the decode worker reused none)
            usage = msgspec.structs.replace(event.usage, cached_tokens=self.handoff.cached_tokens)
            return msgspec.structs.replace(event, usage=usage)
        return event

    async def _reopen(self, reason: str) -> bool:
        assert self.decoder is not None
        logger.warning("decoder %s: %s; retrying on another decoder", self.decoder.url, reason)
        self.fleet.decoder_failed(self.decoder, reason, mark_down=True)
        self.tried.add(self.decoder.url)
        await self.close_stream()
        self._release()
        try:
            await self.open(self.sources)
        except APIError as exc:
            logger.warning("no decoder could take over: %s", exc.message)
            return False
        return True

    async def close_stream(self) -> None:
        if self.resp is not None:
            await self.resp.aclose()
            self.resp = None

    def _release(self) -> None:
        if self.decoder is not None:
            self.fleet.release_decoder(self.decoder, self.chat.prefix_keys if self.finished else ())
            self.decoder = None

    async def close(self) -> None:
        await self.close_stream()
        self._release()
