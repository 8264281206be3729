"""Encoder side of the connector: caches embeddings and serves them over a ROUTER socket."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Any

import torch
import zmq

from connector import messages
from connector.cache import EmbeddingCache
from connector.types import EncoderOutput
from connector.wire import MAX_TENSOR_BYTES, WireError, decode_message, encode_message, peek_req_id

logger = logging.getLogger("epd.connector")

_START_TIMEOUT_S = 10.0
_POLL_MS = 1000  # backstop only: close() wakes the loop through the control socket
_ids = itertools.count()


class ECProducer:
    """Serves `get`/`has`/`ping` for embeddings saved by this encoder process."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0", cache_bytes: int = 1 << 30,
                 max_message_bytes: int = MAX_TENSOR_BYTES) -> None:
        self.bind = bind
        self.max_message_bytes = max_message_bytes
        self._cache = EmbeddingCache(cache_bytes)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ctl_address = f"inproc://epd-producer-ctl-{next(_ids)}-{id(self)}"
        self._address: str | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Counters are written only by the serving thread.
        self._num_gets_served = 0
        self._bytes_sent = 0
        self._num_bad_messages = 0

    @property
    def address(self) -> str:
        """The endpoint consumers connect to, with port 0 resolved."""
        assert self._address is not None, "ECProducer.start() has not been called"
        return self._address

    def start(self) -> ECProducer:
        """Bind the ROUTER socket in a daemon thread and wait until it is listening."""
        assert self._thread is None, "ECProducer already started"
        self._thread = threading.Thread(target=self._serve, name="epd-ec-producer", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise TimeoutError(f"producer did not bind {self.bind} within {_START_TIMEOUT_S}s")
        if self._start_error is not None:
            raise self._start_error
        return self

    def save_caches(self, mm_hash: str, output: EncoderOutput) -> None:
        """Keep an encoder output (as a contiguous CPU tensor) for consumers to fetch."""
        if output.mm_hash != mm_hash:
            raise ValueError(f"save_caches key {mm_hash!r} does not match output.mm_hash {output.mm_hash!r}")
        embeds = output.embeds.detach().to("cpu").contiguous()
        if embeds is not output.embeds:
            output = dataclasses.replace(output, embeds=embeds)
        if not self._cache.put(output):
            logger.warning("embeddings %s (%d bytes) exceed the producer cache; not saved", mm_hash, output.nbytes)

    def has_cache_item(self, mm_hash: str) -> bool:
        return mm_hash in self._cache

    def get_cache_item(self, mm_hash: str) -> EncoderOutput | None:
        """The held output (refreshing its recency), or None."""
        return self._cache.get(mm_hash)

    def stats(self) -> dict[str, Any]:
        """Cache counters plus serving counters."""
        return {
            **self._cache.stats(),
            "gets_served": self._num_gets_served,
            "bytes_sent": self._bytes_sent,
            "bad_messages": self._num_bad_messages,
        }

    def close(self) -> None:
        """Stop the serving thread; the thread closes its own sockets."""
        if self._thread is None:
            return
        self._stop.set()
        waker = self._ctx.socket(zmq.PAIR)
        waker.setsockopt(zmq.LINGER, 0)
        try:
            waker.connect(self._ctl_address)
            waker.send(b"stop", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the thread never bound or already stopped; the stop event is enough
        finally:
            waker.close()
        self._thread.join(timeout=_POLL_MS / 1000 * 5)
        self._thread = None

    # serving thread: the only user of the ROUTER and control sockets

    def _serve(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        ctl = self._ctx.socket(zmq.PAIR)
        for sock in (router, ctl):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            ctl.bind(self._ctl_address)
            router.bind(self.bind)
            self._address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._start_error = e
            self._ready.set()
            router.close()
            ctl.close()
            return
        self._ready.set()
        try:
            self._loop(router, ctl)
        finally:
            router.close()
            ctl.close()

    def _loop(self, router: zmq.Socket, ctl: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(ctl, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_POLL_MS))
            if ctl in events:
                return
            if router in events:
                self._serve_one(router)

    def _serve_one(self, router: zmq.Socket) -> None:
        frames = router.recv_multipart(copy=False)
        identity, payload = frames[0], frames[1:]
        try:
            header, tensors = self._handle(payload)
        except WireError as e:
            header, tensors = self._reject(payload, str(e))
        except Exception as e:  # noqa: BLE001 - no request may kill the serving thread
            logger.exception("producer failed to serve a request")
            header, tensors = self._reject(payload, f"internal error: {type(e).__name__}")
        router.send_multipart([identity, *encode_message(header, tensors)], copy=False)

    def _handle(self, payload: list[zmq.Frame]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        header, _ = decode_message(payload, self.max_message_bytes)
        op, req_id = header["op"], header["req_id"]
        if op == "ping":
            return {"op": "pong", "req_id": req_id}, []
        if op == "has":
            return {"op": "has_reply", "req_id": req_id, "has": [h in self._cache for h in messages.parse_hashes(header)]}, []
        if op == "get":
            return self._get(req_id, messages.parse_hashes(header))
        raise WireError(f"op {op!r} is not a request")

    def _get(self, req_id: int, hashes: list[str]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        found = {h: out for h in dict.fromkeys(hashes) if (out := self._cache.get(h)) is not None}
        header, tensors = messages.get_reply(req_id, hashes, found)
        self._num_gets_served += 1
        self._bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return header, tensors

    def _reject(self, payload: list[zmq.Frame], message: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
        self._num_bad_messages += 1
        logger.warning("producer %s rejected a malformed message: %s", self._address, message)
        return messages.error_reply(peek_req_id(payload), message), []
