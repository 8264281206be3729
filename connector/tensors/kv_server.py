"""A prefill worker's K/V endpoint: a ROUTER thread answering `kv_get`, `kv_release` (and `ping`) from a KVStore,
and expiring the store's entries on a timer (each wake-up, at least every EXPIRE_EVERY_S).

A found hand-off is a KVGetReply header and one raw frame per block from the asked `first_block`, sent from the
stored tensor's memory; or, for a decode worker that asks with `shm` (it has mapped this server's probe segment:
`shm_probe`) and a hand-off held in shared memory, the header alone with the segment's handle. Anything else is
answered without frames: not found, a layout that is not the one held (another model must never get these
blocks), or more bytes than one reply may carry. A malformed request gets an ErrorReply and the thread keeps
serving. CURVE as on every connector link (connector/control/security.py).
"""
from __future__ import annotations

import logging
import math
import secrets
import threading
from typing import Any

import zmq

from connector.control.endpoints import advertised
from connector.control.security import CurveConfig, secure_server, start_authenticator
from connector.control.waker import Waker
from connector.control.wire import WireError, apply_socket_limits, decode_message, encode_message, peek_req_id
from connector.tensors.kv_checks import MAX_KV_REPLY_BYTES, layout_difference
from connector.tensors.kv_store import KVStore
from epd_common.tracing import span
from epd_contracts.ec import ErrorReply, Message, PingRequest, Pong, ShmProbe, ShmProbeReply
from epd_contracts.kv import KVGetReply, KVGetRequest, KVRelease

logger = logging.getLogger("epd.connector")

_START_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 1 << 16  # a kv_get is a key and a layout: well under 1 KiB
_MORE = int(zmq.SNDMORE)
_BATCH = 64  # requests served per wake-up
EXPIRE_EVERY_S = 1.0  # the longest the serving thread sleeps between expiries (an entry put meanwhile is not seen)


class KVServer:
    """Serves one prefill worker's KVStore; other threads only `start`, `close` and read `stats()`."""

    def __init__(self, store: KVStore, bind: str = "tcp://127.0.0.1:0", curve: CurveConfig | None = None,
                 advertise_host: str | None = None, max_reply_bytes: int = MAX_KV_REPLY_BYTES) -> None:
        """`advertise_host`: the host peers on other hosts reach (None: the bound address)."""
        self.bind, self.curve, self.advertise_host, self.max_reply_bytes = bind, curve, advertise_host, max_reply_bytes
        self._store = store
        self._epoch = secrets.token_hex(8)  # what a probe reply names: a restarted server is a new epoch
        # NOTE: a ZAP authenticator is per context, so a server that checks client keys has its own.
        self._ctx: zmq.Context[Any] = (zmq.Context() if curve is not None and curve.allowed_clients is not None
                                       else zmq.Context.instance())
        self._address: str | None = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._waker = Waker()
        # blocks_sent, bytes_sent: by frames; shm_*: answered by handle (no byte sent)
        self._counts = dict.fromkeys(("kv_gets_served", "kv_gets_refused", "blocks_sent", "bytes_sent",
                                      "shm_gets_served", "shm_blocks_served", "shm_bytes_served", "shm_probes",
                                      "kv_releases", "bad_messages"), 0)

    def start(self) -> KVServer:
        """Bind in a daemon thread and wait until it listens."""
        assert self._thread is None, "KVServer already started"
        self._thread = threading.Thread(target=self._serve, name="epd-kv-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise TimeoutError(f"KV server did not bind {self.bind} within {_START_TIMEOUT_S}s")
        if self._start_error is not None:
            self.close()
            raise self._start_error
        return self

    @property
    def address(self) -> str:
        """The ROUTER's endpoint as peers reach it (set by `start`)."""
        assert self._address is not None, "KVServer not started"
        return self._address

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def close(self) -> None:
        """Stop the serving thread (it closes its socket), then the wake pipe."""
        if self._thread is not None:
            self._stop.set()
            self._waker.wake()
            self._thread.join(timeout=5)
            self._thread = None
        self._waker.close()

    # serving thread

    def _serve(self) -> None:
        auth = None
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            auth = start_authenticator(self._ctx, self.curve)
            secure_server(router, self.curve)
            apply_socket_limits(router, MAX_REQUEST_BYTES)
            router.bind(self.bind)
            self._address = advertised(router.getsockopt_string(zmq.LAST_ENDPOINT), self.advertise_host)
        except (zmq.ZMQError, RuntimeError) as e:
            self._start_error = e
        self._ready.set()
        try:
            if self._start_error is None:
                self._loop(router)
        finally:
            router.close()
            if auth is not None:
                auth.stop()
            if self._ctx is not zmq.Context.instance():
                self._ctx.term()

    def _loop(self, router: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            due = self._store.expire()  # the timer: entries nobody asks for go at their TTL, not at the next put
            wait = EXPIRE_EVERY_S if due is None else min(max(due, 0.0), EXPIRE_EVERY_S)
            events = dict(poller.poll(math.ceil(wait * 1000)))
            if self._waker.fileno() in events:
                self._waker.drain()
            # NOTE: a bounded batch, so a flood of requests never keeps the loop from seeing a stop
            for _ in range(_BATCH if router in events else 0):
                if not int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    break
                self._serve_one(router, router.recv_multipart(zmq.NOBLOCK))

    def _serve_one(self, router: zmq.Socket[Any], frames: list[bytes]) -> None:
        identity, payload = frames[0], frames[1:]
        try:
            header, blocks = self._handle(payload)
        except WireError as e:
            header, blocks = self._reject(payload, str(e))
        except Exception as e:  # noqa: BLE001 - no request may kill the serving thread
            logger.exception("KV server failed to serve a request")
            header, blocks = self._reject(payload, f"internal error: {type(e).__name__}")
        head, *tensors = encode_message(header, blocks)
        router.send(identity, _MORE)
        router.send(head, _MORE if tensors else 0)
        for i, buf in enumerate(tensors, 1):
            router.send(buf, _MORE if i < len(tensors) else 0, copy=False)

    def _handle(self, payload: list[bytes]) -> tuple[Message, list[memoryview]]:
        header, _ = decode_message(payload, max_bytes=0)  # requests carry no frames
        if isinstance(header, KVGetRequest):
            if not header.traceparent:
                return self._kv_get(header)
            with span("kv.serve", {"epd.first_block": header.first_block, "epd.shm": header.shm}, "server",
                      header.traceparent) as traced:  # the send follows, outside the span
                reply, blocks = self._kv_get(header, traced)
                if traced is not None:
                    traced.set_attribute("epd.found", reply.found)
                return reply, blocks
        if isinstance(header, KVRelease):  # the decode worker has the blocks: free them now
            self._counts["kv_releases"] += 1
            self._store.release(header.key)
            return Pong(req_id=header.req_id), []
        if isinstance(header, PingRequest):
            return Pong(req_id=header.req_id), []
        if isinstance(header, ShmProbe):
            self._counts["shm_probes"] += 1
            return ShmProbeReply(req_id=header.req_id, epoch=self._epoch, handle=self._store.probe_handle()), []
        raise WireError(f"{type(header).__name__} is not a request a KV server serves")

    def _kv_get(self, request: KVGetRequest, traced: Any = None) -> tuple[KVGetReply, list[memoryview]]:
        """The blocks from `first_block` on, or a reply that says why not (no frames); `traced`: its span, if any."""
        entry = self._store.get(request.key)
        if entry is None:
            return self._refuse(request, "not found")
        if difference := layout_difference(request.layout, entry.layout):
            return self._refuse(request, f"layout differs: {difference}")
        if request.first_block > entry.num_blocks:
            return self._refuse(request, f"first_block {request.first_block} is past the {entry.num_blocks} held")
        nbytes = (entry.num_blocks - request.first_block) * entry.block_nbytes
        if nbytes > self.max_reply_bytes:
            return self._refuse(request, f"{nbytes} bytes of blocks are over the {self.max_reply_bytes}-byte limit")
        handle = entry.shm if request.shm else None  # None for a hand-off on the heap: frames
        blocks = [] if handle is not None else entry.block_buffers(request.first_block)
        self._count_served(handle is not None, entry.num_blocks - request.first_block, nbytes)
        if traced is not None:
            traced.set_attributes({"epd.bytes": nbytes, "epd.transport": "socket" if handle is None else "shm"})
        return KVGetReply(req_id=request.req_id, key=request.key, found=True, layout=entry.layout,
                          num_tokens=entry.num_tokens, num_blocks=entry.num_blocks, first_block=request.first_block,
                          choices=entry.choices, shm=handle), blocks

    def _count_served(self, by_handle: bool, num_blocks: int, nbytes: int) -> None:
        """Before the send: a consumer may read stats() the moment it has the reply."""
        self._counts["kv_gets_served"] += 1
        self._counts["shm_gets_served"] += by_handle
        blocks, nbytes_key = ("shm_blocks_served", "shm_bytes_served") if by_handle else ("blocks_sent", "bytes_sent")
        self._counts[blocks] += num_blocks
        self._counts[nbytes_key] += nbytes

    def _refuse(self, request: KVGetRequest, error: str) -> tuple[KVGetReply, list[memoryview]]:
        self._counts["kv_gets_refused"] += 1
        return KVGetReply(req_id=request.req_id, key=request.key, error=error[:1024]), []

    def _reject(self, payload: list[bytes], message: str) -> tuple[Message, list[memoryview]]:
        self._counts["bad_messages"] += 1
        logger.warning("KV server %s rejected a malformed message: %s", self._address, message)
        return ErrorReply(req_id=peek_req_id(payload), message=message), []
