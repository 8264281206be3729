"""The encoders' /encode calls: scheduled, started detached from any one client, failed over to the other encoders,
moved off busy ones, and each outcome handed by the scheduler to every request waiting for its items."""
from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Collection
from dataclasses import dataclass

import httpx
import msgspec

from connector.control.cache_index import FleetCacheIndex
from epd_common.errors import APIError
from epd_common.http import REQUEST_ID_HEADER
from epd_contracts.encode import EncodeItem, EncodeRequest, EncodeResponse
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics
from proxy.upstream import EncoderBusy, Failure, WorkerFailed, error_code, failover_error, retry_after, upstream_error
from proxy.worker_state import WorkerDown, describe_failure, until_down
from proxy.workers import Workers
from scheduler.scheduler import MMItem, NoEncoderAvailable, Scheduler, SchedulerOutput

logger = logging.getLogger("epd.proxy")
_SEEN_TIMEOUT_S = 0.5  # the index normally has an encoder's events before its HTTP reply arrives
Call = tuple[str, list[MMItem]]  # an encoder's name and the items of one /encode call to it ("", []: none left)


def encode_calls(items: list[MMItem]) -> list[list[MMItem]]:
    """An encoder's share of a schedule as /encode calls: its images in one, each video or audio chunk in its own (a
    chunk carries the whole file: several in one body would multiply it past the encoder's body limit)."""
    images = [it for it in items if it.video is None and it.audio is None]
    return ([images] if images else []) + [[it] for it in items if it.video is not None or it.audio is not None]


@dataclass
class _Busy:
    """The encoders that answered one call busy since it last waited, and when waiting for them ends."""

    names: tuple[str, ...] = ()
    deadline: float | None = None


class EncodeCalls:
    """Every /encode call in flight, over the scheduler's encoders; `headers`: the internal key's."""

    def __init__(self, cfg: ProxyConfig, client: httpx.AsyncClient, metrics: ProxyMetrics, scheduler: Scheduler,
                 index: FleetCacheIndex, workers: Workers, headers: dict[str, str]):
        self.cfg, self.client, self.metrics, self.scheduler = cfg, client, metrics, scheduler
        self.index, self.workers, self.headers = index, workers, headers
        self._calls: set[asyncio.Task[None]] = set()  # encode calls run detached from any one client

    async def close(self) -> None:
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    def schedule(self, items: list[MMItem], skip_cached: bool, exclude: Collection[str]) -> SchedulerOutput:
        try:
            out = self.scheduler.schedule(items, skip_cached, exclude)
        except NoEncoderAvailable as exc:
            raise APIError(503, f"cannot encode the images: {exc}", code="encoder_unavailable") from exc
        self.metrics.items_skipped.inc(len(out.skipped))
        self.metrics.items_joined.inc(len(out.joined))
        self.metrics.items_scheduled.inc(out.num_scheduled)
        return out

    def start(self, name: str, items: list[MMItem], request_id: str, failures: tuple[Failure, ...] = ()) -> None:
        task = asyncio.create_task(self._run(name, items, request_id, failures))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run(self, name: str, items: list[MMItem], request_id: str, failures: tuple[Failure, ...]) -> None:
        """Encode `items` on `name`; the scheduler hands the outcome to every request waiting for them.

        Failover is this loop: the items the failed encoder still owed are scheduled again without any encoder
        that failed them, so each round excludes one more encoder and there are at most as many rounds as encoders.
        """
        busy = _Busy()
        while items:
            hashes = [it.mm_hash for it in items]
            try:
                result: str | APIError = await self._post(name, items, request_id)
            except WorkerFailed as exc:
                failures = (*failures, Failure(name, exc))
                name, items = self._failover(items, request_id, failures)
                continue
            except EncoderBusy as exc:
                name, items = await self._when_busy(name, items, request_id, failures, busy, exc)
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

    async def _when_busy(self, name: str, items: list[MMItem], request_id: str, failures: tuple[Failure, ...],
                         busy: _Busy, exc: EncoderBusy) -> Call:
        """`name` answered busy: the call moves to an encoder that is not (it stays in service); with none free, the
        same call again after the encoder's Retry-After; the items end with 503 encoders_saturated when every encoder
        stayed busy past --encoder-busy-timeout."""
        self.metrics.encoder_busy.inc()
        busy.names = (*busy.names, name)
        loop = asyncio.get_running_loop()
        busy.deadline = busy.deadline if busy.deadline is not None else loop.time() + self.cfg.encoder_busy_timeout
        if self._free_encoders([f.encoder for f in failures] + list(busy.names)):
            return self._move(name, items, request_id, failures, busy.names)
        wait = min(exc.retry_after, busy.deadline - loop.time())
        if wait <= 0:  # every encoder stayed busy past the deadline
            saturated = APIError(503, f"the encoders are saturated: every encoder answered busy for "
                                      f"{self.cfg.encoder_busy_timeout:g} s; retry later",
                                 code="encoders_saturated", headers={"Retry-After": f"{exc.retry_after:g}"})
            self.scheduler.update_from_output(name, [it.mm_hash for it in items], saturated)
            return "", []
        await asyncio.sleep(wait)  # the encoder's Retry-After: then the same call again, here first
        busy.names = ()
        return name, items

    def _failover(self, items: list[MMItem], request_id: str, failures: tuple[Failure, ...]) -> Call:
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
            out = self.schedule([it for it in items if it.mm_hash in owed], True, [f.encoder for f in failures])
        except APIError as err:  # no encoder is left
            self.scheduler.settle(failed.encoder, owed, failover_error(err, failures))
            return "", []
        return self._go_on(out, request_id, failures)

    def _free_encoders(self, exclude: Collection[str]) -> list[str]:
        return [n for n in self.scheduler.healthy_names() if n not in exclude]

    def _move(self, name: str, items: list[MMItem], request_id: str, failures: tuple[Failure, ...],
              busy: tuple[str, ...]) -> Call:
        """Reschedule a busy encoder's items on the others (not a failure: it stays in service); returns the call
        this loop goes on with (the rest of a split starts on its own)."""
        owed = self.scheduler.take_back(name, [it.mm_hash for it in items])
        try:
            out = self.schedule([it for it in items if it.mm_hash in owed], True,
                                [*(f.encoder for f in failures), *busy])
        except APIError as err:  # the others went down meanwhile
            self.scheduler.settle(name, owed, err)
            return "", []
        return self._go_on(out, request_id, failures)

    def _go_on(self, out: SchedulerOutput, request_id: str, failures: tuple[Failure, ...]) -> Call:
        """The first call of a new schedule, for the loop to go on with; the others start on their own."""
        calls = [(n, call) for n, todo in out.scheduled_encoder_inputs.items() for call in encode_calls(todo)]
        for n, todo in calls[1:]:
            self.start(n, todo, request_id, failures)
        return calls[0] if calls else ("", [])

    async def _post(self, name: str, items: list[MMItem], request_id: str) -> str:
        """One /encode call; the ZeroMQ address holding the items once the index has seen them stored."""
        worker = self.workers.by_url.get(name)
        if worker is None:
            raise WorkerFailed("deregistered")
        body = EncodeRequest(items=[EncodeItem(mm_hash=it.mm_hash, data=base64.b64encode(it.data).decode(),
                                               detail=it.detail, multi_image=it.multi_image, video=it.video,
                                               audio=it.audio, lora=it.lora) for it in items])
        headers = {REQUEST_ID_HEADER: request_id, "content-type": "application/json", **self.headers}
        try:
            resp = await until_down(self.client.post(f"{name}/encode", content=msgspec.json.encode(body),
                                                     headers=headers, timeout=self.cfg.worker_timeout), worker)
        except WorkerDown as exc:
            raise WorkerFailed(f"marked down: {worker.reason}") from exc
        except httpx.HTTPError as exc:
            self.workers.mark_down(worker, f"encode call failed: {describe_failure(exc)}")
            raise WorkerFailed(type(exc).__name__) from exc
        except AttributeError as exc:  # anyio's getpeername on a socket the dying encoder already closed (seen on
            # CI when an encoder was killed mid-call: 'NoneType' object has no attribute 'getpeername'): its failure
            self.workers.mark_down(worker, f"encode call failed: connection torn down ({exc})")
            raise WorkerFailed("connection torn down") from exc
        encoded = _encoded(resp, name)
        await self._seen(encoded)
        return encoded.ec_address

    async def _seen(self, encoded: EncodeResponse) -> None:
        """Read your writes: wait (briefly) until the index has the encoder's events for these items."""
        position = (encoded.ec_address, encoded.ec_epoch, encoded.ec_seq)
        if not self.index.has_seen(*position):
            await asyncio.to_thread(self.index.wait_for, lambda: self.index.has_seen(*position), _SEEN_TIMEOUT_S)


def _encoded(resp: httpx.Response, name: str) -> EncodeResponse:
    """An encoder's answer: its EncodeResponse, or what its failure is (busy, failed, the request's own error)."""
    if resp.status_code == 503 and error_code(resp.content) == "encoder_busy":
        raise EncoderBusy(retry_after(resp.headers.get("retry-after")))
    if resp.status_code >= 500:
        raise WorkerFailed(f"answered {resp.status_code}", upstream_error(resp, resp.content, f"encoder {name}"))
    if resp.status_code != 200:
        raise upstream_error(resp, resp.content, f"encoder {name}")
    try:
        return msgspec.json.decode(resp.content, type=EncodeResponse)
    except msgspec.MsgspecError as exc:  # it answered, but not the contract: like a 5xx, retried once elsewhere
        raise WorkerFailed("answered 200 with an unreadable body", APIError(
            502, f"encoder {name} answered 200 with an unreadable body: {exc}", code="upstream_error")) from exc
