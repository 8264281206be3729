"""A self-pipe that lets any thread wake a ZeroMQ poll loop (zmq.Poller polls its file descriptor)."""

from __future__ import annotations

import os
import threading


class Waker:
    """`wake()` from any thread; the loop polls `fileno()` and calls `drain()` when it is readable."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)
        self._lock = threading.Lock()  # so close() never races a write into a reused descriptor

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._w < 0:
                return
            try:
                os.write(self._w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: the loop has wake-ups pending anyway

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._w >= 0:
                os.close(self._w)
                os.close(self._r)
                self._w = self._r = -1
