"""DEALER sockets to producers, pooled per address so concurrent requests never share one."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from connector.control.security import CurveConfig, secure_client
from connector.control.wire import apply_socket_limits

MAX_IDLE_PER_PEER = 8
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: pyzmq's enum flags cost an enum call per use


class PeerChannel:
    """A DEALER socket to `address`, used by one request at a time (checked out of a ChannelPool)."""

    def __init__(self, ctx: zmq.Context[Any], address: str, curve: CurveConfig | None, max_bytes: int) -> None:
        self.address = address
        self._ctx, self._curve, self._max_bytes = ctx, curve, max_bytes
        self._socket: zmq.Socket[Any] | None = None
        self._rcvtimeo = -1  # what the open socket has; setsockopt costs a libzmq call, cold after big replies

    @property
    def is_open(self) -> bool:
        return self._socket is not None

    def socket(self) -> zmq.Socket[Any]:
        """Return the socket, connecting it on first use."""
        if self._socket is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                secure_client(sock, self._curve)
                apply_socket_limits(sock, self._max_bytes)
                sock.connect(self.address)
            except zmq.ZMQError:
                sock.close()  # a bad address must not leak an unclosed socket
                raise
            self._socket = sock
        return self._socket

    def send(self, frames: list[bytes | memoryview]) -> bool:
        """Queue a request without blocking; False when the socket cannot take it."""
        try:
            if len(frames) == 1:
                self.socket().send(frames[0], _NOBLOCK)  # requests are one small frame
            else:
                self.socket().send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.reset()
            return False
        return True

    def set_rcvtimeo(self, ms: int) -> None:
        """Bound the next blocking receive on the open socket to `ms` milliseconds."""
        if ms != self._rcvtimeo:
            self.socket().setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms

    def reset(self) -> None:
        """Drop the socket (and any late reply queued on it); the next use reconnects."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            self._rcvtimeo = -1


class ChannelPool:
    """Idle channels per producer address; a checked-out channel belongs to one request."""

    def __init__(self, ctx: zmq.Context[Any], curve: CurveConfig | None, max_bytes: int) -> None:
        self._ctx, self._curve, self._max_bytes = ctx, curve, max_bytes
        self._idle: dict[str, list[PeerChannel]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def checkout(self, address: str) -> PeerChannel:
        with self._lock:
            if self._closed:
                raise RuntimeError("the connector client is closed")
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        return PeerChannel(self._ctx, address, self._curve, self._max_bytes)

    def checkin(self, channel: PeerChannel) -> None:
        """Return a channel; it is closed instead when the pool is closed or full, or the socket was reset."""
        with self._lock:
            idle = self._idle.setdefault(channel.address, [])
            if not self._closed and channel.is_open and len(idle) < MAX_IDLE_PER_PEER:
                idle.append(channel)
                return
        channel.reset()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for channel in channels:
            channel.reset()
