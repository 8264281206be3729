"""One lazily created DEALER socket to one producer, used under its own lock."""

from __future__ import annotations

import threading
from typing import Any

import zmq


class PeerChannel:
    """A DEALER socket to `address`; hold `lock` around every use of `socket()`."""

    def __init__(self, ctx: zmq.Context[Any], address: str) -> None:
        self.address = address
        self.lock = threading.Lock()
        self._ctx = ctx
        self._socket: zmq.Socket[Any] | None = None

    def socket(self) -> zmq.Socket[Any]:
        """Return the socket, connecting it on first use."""
        if self._socket is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(self.address)
            except zmq.ZMQError:
                sock.close()  # a bad address must not leak an unclosed socket
                raise
            self._socket = sock
        return self._socket

    def send(self, frames: list[bytes | memoryview]) -> bool:
        """Queue a request without blocking; False when the socket cannot take it."""
        try:
            self.socket().send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.reset()
            return False
        return True

    def reset(self) -> None:
        """Drop the socket (and any late reply queued on it); the next use reconnects."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
