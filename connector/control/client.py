"""Requests to producers over pooled DEALER sockets: has, ping, snapshot, and the exchange a gather builds on."""
from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any, TypeVar

import zmq

from connector.control.channel import ChannelPool, PeerChannel
from connector.control.security import CurveConfig
from connector.control.wire import (
    MAX_FRAMES,
    MAX_REPLY_HEADER_BYTES,
    MAX_TENSOR_BYTES,
    WireError,
    decode_message,
    encode_message,
    peek_req_id,
)
from epd_contracts.ec import (
    ErrorReply,
    HasReply,
    HasRequest,
    Message,
    PingRequest,
    Pong,
    Request,
    SnapshotReply,
    SnapshotRequest,
)

logger = logging.getLogger("epd.connector")

Reply = tuple[Message, list[memoryview]]  # (header, tensor frame buffers)
T = TypeVar("T")


class ProducerClient:
    """Sends requests to producers and collects their replies (one pooled socket per request in flight)."""

    def __init__(self, curve: CurveConfig | None = None, max_message_bytes: int = MAX_TENSOR_BYTES,
                 max_reply_bytes: int = MAX_TENSOR_BYTES, max_frames: int = MAX_FRAMES) -> None:
        """`max_message_bytes` bounds each frame (libzmq drops a peer sending a bigger part);
        `max_reply_bytes` bounds the tensor bytes of one reply (checked before any tensor is built);
        `max_frames` the frames of one reply (a K/V consumer allows one per block: MAX_KV_FRAMES)."""
        self.max_message_bytes, self.max_reply_bytes = max_message_bytes, max_reply_bytes
        self._max_frames = max_frames
        self._pool = ChannelPool(zmq.Context.instance(), curve, max_message_bytes)
        self._req_ids = itertools.count(1)

    def next_req_id(self) -> int:
        return next(self._req_ids)

    def query(self, address: str, mm_hashes: list[str], timeout: float = 2.0) -> list[bool]:
        """Ask one producer which items it holds; all False if it does not answer in time."""
        if not mm_hashes:
            return []
        reply = self.exchange({address: HasRequest(req_id=self.next_req_id(), hashes=mm_hashes)}, timeout)
        try:
            flags = expect(reply.get(address), HasReply, address).has
        except WireError as e:
            logger.warning("bad has_reply from %s: %s", address, e)
            return [False] * len(mm_hashes)
        if len(flags) != len(mm_hashes):
            logger.warning("bad has_reply from %s: %d flag(s) for %d hash(es)", address, len(flags), len(mm_hashes))
            return [False] * len(mm_hashes)
        return flags

    def snapshot(self, address: str, timeout: float = 2.0) -> SnapshotReply | None:
        """Everything one producer holds (epoch, seq, hashes), or None if it does not answer in time."""
        reply = self.exchange({address: SnapshotRequest(req_id=self.next_req_id())}, timeout).get(address)
        try:
            return expect(reply, SnapshotReply, address)
        except WireError as e:
            logger.warning("no snapshot from %s: %s", address, e)
            return None

    def ping(self, address: str, timeout: float = 2.0) -> bool:
        """Whether a producer answers a ping in time."""
        reply = self.exchange({address: PingRequest(req_id=self.next_req_id())}, timeout).get(address)
        return reply is not None and isinstance(reply[0], Pong)

    def close(self) -> None:
        """Close every idle producer socket; the client cannot be used afterwards."""
        self._pool.close()

    def exchange(self, requests: dict[str, Request], timeout: float) -> dict[str, Reply]:
        """Send each request to its producer, then collect replies until `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        channels = [self._pool.checkout(addr) for addr in requests]
        try:
            pending: dict[zmq.Socket[Any], tuple[PeerChannel, int]] = {}  # socket -> (channel, req_id)
            for channel in channels:
                req = requests[channel.address]
                if channel.send(encode_message(req)):
                    pending[channel.socket()] = (channel, req.req_id)
            replies = self._collect(pending, deadline)
            for channel, _ in pending.values():
                # NOTE: a timed-out socket may still get the late reply; a fresh one never will.
                channel.reset()
        finally:
            for channel in channels:
                self._pool.checkin(channel)
        return replies

    def exchange_one(self, address: str, request: Request, timeout: float) -> Reply | None:
        """`exchange` for one producer (the common gather), without the bookkeeping of several: None on a timeout."""
        deadline = time.monotonic() + timeout
        channel = self._pool.checkout(address)
        try:
            if not channel.send(encode_message(request)):
                return None
            replies = self._collect({channel.socket(): (channel, request.req_id)}, deadline)
            if not replies:
                channel.reset()  # a timed-out socket may still get the late reply; a fresh one never will
            return replies.get(address)
        finally:
            self._pool.checkin(channel)

    def _collect(self, pending: dict[zmq.Socket[Any], tuple[PeerChannel, int]], deadline: float) -> dict[str, Reply]:
        """Read replies into a dict (address -> reply), removing answered sockets from `pending`."""
        replies: dict[str, Reply] = {}
        if len(pending) == 1:  # the common case: one producer; a blocking receive with a timeout, no poll
            (sock, (channel, req_id)), = pending.items()
            while (remaining_s := deadline - time.monotonic()) > 0:
                channel.set_rcvtimeo(math.ceil(remaining_s * 1000))
                try:
                    reply = self._read(sock, channel.address, req_id)
                except zmq.Again:
                    break
                if reply is not None:
                    replies[channel.address] = reply
                    del pending[sock]
                    break
            return replies
        poller = zmq.Poller()
        for sock in pending:
            poller.register(sock, zmq.POLLIN)
        while pending and (remaining_s := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(math.ceil(remaining_s * 1000)):
                channel, req_id = pending[sock]
                reply = self._read(sock, channel.address, req_id)
                if reply is not None:
                    replies[channel.address] = reply
                    del pending[sock]
                    poller.unregister(sock)
        return replies

    def _read(self, sock: zmq.Socket[Any], address: str, req_id: int) -> Reply | None:
        """Decode one reply; None for a malformed one or a stale one of an earlier request."""
        frames = sock.recv_multipart(copy=False)
        try:
            header, buffers = decode_message(frames, self.max_message_bytes, MAX_REPLY_HEADER_BYTES, self._max_frames)
        except WireError as e:
            logger.warning("malformed reply from %s: %s", address, e)
            if peek_req_id(frames) == req_id:  # the answer to this request, unusable: fail now, not at the timeout
                return ErrorReply(req_id=req_id, message=f"malformed reply: {e}"), []
            return None
        if header.req_id != req_id:
            logger.debug("discarding stale reply %s from %s", header.req_id, address)
            return None
        total = sum(buf.nbytes for buf in buffers)
        if total > self.max_reply_bytes:  # refused before any tensor is built; the frames are freed on return
            logger.warning("refusing a reply of %d tensor bytes from %s (over the %d-byte cap)", total, address,
                           self.max_reply_bytes)
            return ErrorReply(req_id=req_id, message=f"reply of {total} bytes over the consumer cap"), []
        return header, buffers


def expect(reply: Reply | None, kind: type[T], address: str) -> T:
    """The reply's header if it is a `kind`; WireError for none, an error reply, or another op."""
    if reply is None:
        raise WireError(f"no reply from {address}")
    header = reply[0]
    if isinstance(header, ErrorReply):
        raise WireError(f"producer error: {header.message!r}")
    if not isinstance(header, kind):
        raise WireError(f"expected {kind.__name__}, got {type(header).__name__}")
    return header
