"""The workers behind the proxy: encode fan-out with dedupe and failover, decoder calls, upstream errors."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import httpx
import msgspec

from connector.control.cache_index import FleetCacheIndex
from epd_common.errors import APIError
from epd_common.http import REQUEST_ID_HEADER
from epd_contracts.encode import EncodeItem, EncodeRequest, EncodeResponse
from epd_contracts.generate import GenerateRequest
from proxy.config import ProxyConfig
from proxy.decoder_http import DecoderHTTP, DecoderResponse
from proxy.metrics import ProxyMetrics
from proxy.workers import ModelMismatch, Worker, WorkerDown, Workers, describe_failure, until_down
from scheduler.scheduler import EncoderSlot, MMItem, NoEncoderAvailable, Scheduler, SchedulerOutput

logger = logging.getLogger("epd.proxy")
_SEEN_TIMEOUT_S = 0.5  # the index normally has an encoder's events before its HTTP reply arrives
_JSON = {"content-type": "application/json"}  # request bodies are msgspec-encoded contracts


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


def encode_calls(items: list[MMItem]) -> list[list[MMItem]]:
    """An encoder's share of a schedule as /encode calls: its images in one, each video or audio chunk in its own (a
    chunk carries the whole file: several in one body would multiply it past the encoder's body limit)."""
    images = [it for it in items if it.video is None and it.audio is None]
    return ([images] if images else []) + [[it] for it in items if it.video is not None or it.audio is not None]


class Fleet:
    def __init__(self, cfg: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics):
        self.cfg, self.client, self.metrics = cfg, client, metrics
        self.decoder_http = DecoderHTTP(cfg.worker_timeout)  # the /generate streams; httpx for every other call
        self.index = FleetCacheIndex(cfg.curve)
        self.scheduler = Scheduler()
        self.workers = Workers(client, cfg.health_interval, cfg.health_timeout, cfg.health_failures,
                               on_up=self._on_up, on_down=self._on_down,
                               load_gap=cfg.affinity_load_gap if cfg.prefix_affinity else None,
                               on_route=lambda route: metrics.affinity_routed.labels(route).inc())
        self._calls: set[asyncio.Task[None]] = set()  # encode calls run detached from any one client
        self.internal_headers = {"Authorization": f"Bearer {cfg.internal_key}"} if cfg.internal_key else {}
        metrics.watch(self)

    async def start(self) -> None:
        """Wait for every configured worker's /health (learning each encoder's ZeroMQ address); start probing."""
        roles = {"encoder": self.cfg.encode_urls, "decoder": self.cfg.decode_urls, "prefill": self.cfg.prefill_urls}
        for role, urls in roles.items():
            for url in urls:
                self.workers.add(role, url)
        deadline = time.monotonic() + self.cfg.startup_timeout
        await self.workers.wait_healthy([url for urls in roles.values() for url in urls], deadline)
        addresses = [w.info["ec_address"] for w in self.workers.of("encoder")]
        if not await asyncio.to_thread(self.index.wait_for, lambda: all(map(self.index.is_synced, addresses)), 5.0):
            logger.warning("cache index not synced with every encoder yet; it will catch up from their events")
        self.workers.start()

    def max_model_len(self) -> int | None:
        """The longest context any decoder reports on /health (None: none says): what a prompt surely cannot pass."""
        lengths = [n for w in self.workers.of("decoder") if isinstance(n := w.info.get("max_model_len"), int)
                   and not isinstance(n, bool) and n > 0]
        return max(lengths, default=None)

    def served_model_name(self) -> str | None:
        """--served-model-name, else the name of the model the workers report (None until one has)."""
        return self.cfg.served_model_name or self.workers.model_name

    async def close(self) -> None:
        await self.workers.stop()
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        self.decoder_http.close()
        self.index.close()

    # membership

    async def register(self, role: str, url: str) -> Worker:
        """Add a worker at run time (POST /instances); it gets work once its first probe succeeds."""
        worker = self.workers.add(role, url)
        await self.workers.probe(worker)
        if worker.reason.startswith("model_mismatch"):
            reason = worker.reason
            self.workers.remove(url)
            raise ModelMismatch(f"{role} {url} refused: {reason}")
        return worker

    def deregister(self, url: str) -> Worker | None:
        return self.workers.remove(url)

    def _on_up(self, worker: Worker) -> None:
        if worker.role != "encoder":
            return
        address, events = worker.info.get("ec_address"), worker.info.get("ec_events_address")
        if not isinstance(address, str) or not isinstance(events, str):
            self.workers.mark_down(worker, "its /health names no ec_address / ec_events_address")
            return
        slot = self.scheduler.encoders.get(worker.url)
        if slot is None or slot.ec_address != address:  # new, or restarted on another address
            if slot is not None:
                self.index.remove(slot.ec_address)
            self.index.add(address, events)
            self.scheduler.add(EncoderSlot(name=worker.url, ec_address=address, cache=self.index.view(address)))
        self.scheduler.set_healthy(worker.url, True)

    def _on_down(self, worker: Worker) -> None:
        self.metrics.workers_marked_down.labels(worker.role).inc()
        if worker.role == "encoder":
            self.scheduler.set_healthy(worker.url, False)
            if worker.url not in self.workers.by_url:  # deregistered
                self.scheduler.remove(worker.url)

    # encoding

    async def encode(self, items: list[MMItem], request_id: str, skip_cached: bool = True) -> dict[str, str]:
        """Make sure every item is held by some encoder; returns mm_hash -> ZeroMQ address."""
        return await self.execute(self.plan(items, skip_cached), request_id)

    def plan(self, items: list[MMItem], skip_cached: bool = True) -> SchedulerOutput:
        """Schedule the items (no I/O): the scheduler records each encode in flight with its future."""
        if not items or self.cfg.aggregated:  # aggregated: the decoder encodes what it is sent
            return SchedulerOutput()
        return self._schedule(items, skip_cached, ())

    async def execute(self, plan: SchedulerOutput, request_id: str) -> dict[str, str]:
        """Start the plan's encode calls (detached: a client that leaves does not cancel work others joined)
        and wait until every item is stored somewhere; returns mm_hash -> ZeroMQ address."""
        start = time.perf_counter()
        for name, todo in plan.scheduled_encoder_inputs.items():
            for call in encode_calls(todo):
                self._start_call(name, call, request_id, ())
        sources = dict(plan.sources)
        for h, result in plan.waits.items():
            try:
                sources[h] = await asyncio.shield(asyncio.wrap_future(result))
            except APIError as err:
                if err.status < 500 and (err.param or "").startswith("items."):
                    raise ItemRefused(err, h) from err
                raise
        if plan.scheduled_encoder_inputs:
            self.metrics.encode_seconds.observe(time.perf_counter() - start)
        return sources

    def _schedule(self, items: list[MMItem], skip_cached: bool, exclude: Collection[str]) -> SchedulerOutput:
        try:
            out = self.scheduler.schedule(items, skip_cached, exclude)
        except NoEncoderAvailable as exc:
            raise APIError(503, f"cannot encode the images: {exc}", code="encoder_unavailable") from exc
        self.metrics.items_skipped.inc(len(out.skipped))
        self.metrics.items_joined.inc(len(out.joined))
        self.metrics.items_scheduled.inc(out.num_scheduled)
        return out

    def _start_call(self, name: str, items: list[MMItem], request_id: str, failures: tuple[Failure, ...]) -> None:
        task = asyncio.create_task(self._encode_call(name, items, request_id, failures))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _encode_call(self, name: str, items: list[MMItem], request_id: str,
                           failures: tuple[Failure, ...]) -> None:
        """Encode `items` on `name`; the scheduler hands the outcome to every request waiting for them.

        Failover is this loop: the items the failed encoder still owed are scheduled again without any encoder
        that failed them, so each round excludes one more encoder and there are at most as many rounds as encoders.
        """
        busy: tuple[str, ...] = ()  # encoders that answered busy since the last wait
        deadline: float | None = None  # when every encoder has been busy for too long
        while items:
            hashes = [it.mm_hash for it in items]
            try:
                result: str | APIError = await self._post_encode(name, items, request_id)
            except WorkerFailed as exc:
                failures = (*failures, Failure(name, exc))
                name, items = self._failover(items, request_id, failures)
                continue
            except EncoderBusy as exc:
                self.metrics.encoder_busy.inc()
                busy = (*busy, name)
                loop = asyncio.get_running_loop()
                deadline = deadline if deadline is not None else loop.time() + self.cfg.encoder_busy_timeout
                if self._free_encoders([f.encoder for f in failures] + list(busy)):
                    name, items = self._move(name, items, request_id, failures, busy)
                    continue
                wait = min(exc.retry_after, deadline - loop.time())
                if wait <= 0:  # every encoder stayed busy past the deadline
                    result = APIError(503, f"the encoders are saturated: every encoder answered busy for "
                                           f"{self.cfg.encoder_busy_timeout:g} s; retry later",
                                      code="encoders_saturated", headers={"Retry-After": f"{exc.retry_after:g}"})
                    self.scheduler.update_from_output(name, hashes, result)
                    return
                await asyncio.sleep(wait)  # the encoder's Retry-After: then the same call again, here first
                busy = ()
                continue
            except APIError as err:  # the request's own fault (4xx): not retried elsewhere
                result = err
            except asyncio.CancelledError:
                self.scheduler.update_from_output(name, hashes, APIError(503, "proxy is shutting down",
                                                                         code="shutting_down"))
                raise
            except Exception as exc:  # a bug here must still answer every request waiting for these items
                logger.exception("encode call to %s failed unexpectedly", name)
                result = APIError(500, f"encode call failed: {type(exc).__name__}", code="internal_error")
            self.scheduler.update_from_output(name, hashes, result)
            return

    def _failover(self, items: list[MMItem], request_id: str,
                  failures: tuple[Failure, ...]) -> tuple[str, list[MMItem]]:
        """Reschedule the items the last failed encoder still owed; returns the call this loop goes on with
        (the rest of a split starts on its own), or ("", []) when nothing is left to encode."""
        failed = failures[-1]
        owed = self.scheduler.take_back(failed.encoder, [it.mm_hash for it in items])
        if failed.error.answer is not None and len(failures) > 1:  # answered 5xx on the retry: the request's own error
            self.scheduler.settle(failed.encoder, owed, failover_error(failed.error.answer, failures[:-1]))
            return "", []
        self.metrics.failovers.labels("encoder").inc()
        logger.warning("encoder %s failed (%s); rescheduling %d item(s)", failed.encoder, failed.error, len(owed))
        try:
            out = self._schedule([it for it in items if it.mm_hash in owed], True, [f.encoder for f in failures])
        except APIError as err:  # no encoder is left
            self.scheduler.settle(failed.encoder, owed, failover_error(err, failures))
            return "", []
        calls = [(name, call) for name, todo in out.scheduled_encoder_inputs.items() for call in encode_calls(todo)]
        for name, todo in calls[1:]:
            self._start_call(name, todo, request_id, failures)
        return calls[0] if calls else ("", [])

    def _free_encoders(self, exclude: Collection[str]) -> list[str]:
        return [n for n in self.scheduler.healthy_names() if n not in exclude]

    def _move(self, name: str, items: list[MMItem], request_id: str, failures: tuple[Failure, ...],
              busy: tuple[str, ...]) -> tuple[str, list[MMItem]]:
        """Reschedule a busy encoder's items on the others (not a failure: it stays in service); returns the call
        this loop goes on with (the rest of a split starts on its own)."""
        owed = self.scheduler.take_back(name, [it.mm_hash for it in items])
        try:
            out = self._schedule([it for it in items if it.mm_hash in owed], True,
                                 [*(f.encoder for f in failures), *busy])
        except APIError as err:  # the others went down meanwhile
            self.scheduler.settle(name, owed, err)
            return "", []
        calls = [(n, call) for n, todo in out.scheduled_encoder_inputs.items() for call in encode_calls(todo)]
        for n, todo in calls[1:]:
            self._start_call(n, todo, request_id, failures)
        return calls[0] if calls else ("", [])

    async def _post_encode(self, name: str, items: list[MMItem], request_id: str) -> str:
        worker = self.workers.by_url.get(name)
        if worker is None:
            raise WorkerFailed("deregistered")
        body = EncodeRequest(items=[EncodeItem(mm_hash=it.mm_hash, data=base64.b64encode(it.data).decode(),
                                               detail=it.detail, multi_image=it.multi_image, video=it.video,
                                               audio=it.audio) for it in items])
        headers = {REQUEST_ID_HEADER: request_id, **_JSON, **self.internal_headers}
        try:
            resp = await until_down(self.client.post(f"{name}/encode", content=msgspec.json.encode(body), headers=headers,
                                                     timeout=self.cfg.worker_timeout), worker)
        except WorkerDown as exc:
            raise WorkerFailed(f"marked down: {worker.reason}") from exc
        except httpx.HTTPError as exc:
            self.workers.mark_down(worker, f"encode call failed: {describe_failure(exc)}")
            raise WorkerFailed(type(exc).__name__) from exc
        if resp.status_code == 503 and _error_code(resp.content) == "encoder_busy":
            raise EncoderBusy(_retry_after(resp.headers.get("retry-after")))
        if resp.status_code >= 500:
            raise WorkerFailed(f"answered {resp.status_code}", upstream_error(resp, resp.content, f"encoder {name}"))
        if resp.status_code != 200:
            raise upstream_error(resp, resp.content, f"encoder {name}")
        try:
            encoded = msgspec.json.decode(resp.content, type=EncodeResponse)
        except msgspec.MsgspecError as exc:  # it answered, but not the contract: like a 5xx, retried once elsewhere
            raise WorkerFailed("answered 200 with an unreadable body", APIError(
                502, f"encoder {name} answered 200 with an unreadable body: {exc}", code="upstream_error")) from exc
        await self._seen(encoded)
        return encoded.ec_address

    async def _seen(self, encoded: EncodeResponse) -> None:
        """Read your writes: wait (briefly) until the index has the encoder's events for these items."""
        position = (encoded.ec_address, encoded.ec_epoch, encoded.ec_seq)
        if not self.index.has_seen(*position):
            await asyncio.to_thread(self.index.wait_for, lambda: self.index.has_seen(*position), _SEEN_TIMEOUT_S)

    # decoding (and prefill workers: E -> P -> D)
    def acquire_decoder(self, exclude: set[str], prefix_keys: Sequence[str] = (), role: str = "decoder") -> Worker:
        return self.workers.acquire_decoder(exclude, prefix_keys, role)

    @property
    def splits_prefill(self) -> bool:  # E -> P -> D: prefill workers configured or registered; requests start there
        return not self.cfg.aggregated and bool(self.workers.of("prefill"))

    def release_decoder(self, worker: Worker, finished_keys: Sequence[str] = ()) -> None:
        """The generation is over; `finished_keys`: it finished there, so the decoder holds their K/V now."""
        worker.load -= 1
        if finished_keys:
            worker.prefixes.finished(finished_keys)

    def decoder_failed(self, worker: Worker, reason: str, mark_down: bool) -> None:
        self.metrics.failovers.labels("decoder").inc()
        if mark_down:
            self.workers.mark_down(worker, reason)

    async def open_generation(self, worker: Worker, generate: GenerateRequest, request_id: str) -> DecoderResponse:
        """POST /generate (proxy/decoder_http.py); returns the open streaming response. Raises WorkerFailed (retry
        on another decoder) or APIError (the request's own fault, or missing embeddings)."""
        headers = {REQUEST_ID_HEADER: request_id, **_JSON, **self.internal_headers}
        try:
            resp = await until_down(self.decoder_http.post_stream(worker.url, "/generate", msgspec.json.encode(generate),
                                                                  headers), worker)
        except WorkerDown as exc:
            raise WorkerFailed(f"marked down: {worker.reason}") from exc
        except httpx.HTTPError as exc:
            self.workers.mark_down(worker, f"generate call failed: {describe_failure(exc)}")
            raise WorkerFailed(type(exc).__name__) from exc
        if resp.status_code != 200:
            body = await resp.aread()
            await resp.aclose()
            if resp.status_code >= 500:
                raise WorkerFailed(f"answered {resp.status_code}", upstream_error(resp, body, f"decoder {worker.url}"))
            raise upstream_error(resp, body, f"decoder {worker.url}")
        return resp


_MAX_RETRY_AFTER_S = 5.0  # an encoder's Retry-After is honoured up to this (the proxy's own deadline bounds the rest)


def _error_code(body: bytes) -> object:
    try:
        return msgspec.json.decode(body).get("error", {}).get("code")
    except (msgspec.MsgspecError, AttributeError):
        return None


def _retry_after(value: str | None) -> float:
    """Retry-After in seconds (its delay form), within (0, 5]; 1 when absent or not a number."""
    try:
        seconds = float(value if value is not None else 1.0)
    except ValueError:
        return 1.0
    return min(max(seconds, 0.05), _MAX_RETRY_AFTER_S) if seconds == seconds else 1.0
