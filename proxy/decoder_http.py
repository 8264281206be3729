"""The proxy's HTTP/1.1 client for its one hot call, POST /generate on a decoder, on asyncio streams.

Every other call (health probes, /encode, registration) goes through httpx. For this one, httpx costs most of
the proxy's time: a pass-through proxy on raw asyncio streams served 4.9x the streamed requests per CPU second of
the same pass-through on httpx, and answered 0.6 ms sooner (docs/BENCHMARKS.md, "Proxy overhead"). This client
does what the call needs and nothing more:
- keep-alive connections per decoder;
- one write per request;
- a body read by content-length, chunked, or until the connection closes (HTTP/1.0).
A connection whose answer was not read to its end is closed, which is how the decoder learns that a generation
is no longer wanted. Every failure is the httpx exception the callers already handle: ConnectError, ConnectTimeout,
WriteError, ReadTimeout, ReadError, RemoteProtocolError. The decoder is bounded too: a response head over
MAX_HEAD_BYTES, a line or chunk over MAX_LINE_BYTES, or an error body over MAX_ERROR_BODY_BYTES is a
RemoteProtocolError.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable
from urllib.parse import urlsplit

import httpx

from epd_common.tracing import TRACEPARENT, traceparent

MAX_HEAD_BYTES = 64 << 10  # status line + headers of one answer
MAX_LINE_BYTES = 16 << 20  # one NDJSON event (logprobs included) or one chunk
MAX_ERROR_BODY_BYTES = 1 << 20  # a non-200 answer's body, read whole
MAX_IDLE_PER_DECODER = 64  # keep-alive connections kept per decoder; more are closed when released
_READ = 64 << 10

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class DecoderHTTP:
    """Keep-alive connections per decoder URL (`http://host:port` or `https://...`) and one POST at a time on each."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # per connect, write and read, as httpx's
        self._idle: dict[str, list[Conn]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post_stream(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> DecoderResponse:
        """Send the request and read the answer's head; the body is read from the returned response.

        A kept-alive connection the decoder closed in the meantime (its keep-alive timer) fails before any byte of
        an answer: the request is then sent once more on a new connection, as the decoder never saw it."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        fields = [f"host: {parts.netloc}", f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        if tp := traceparent():  # the calling task's span (epd_common/tracing.py): the decoder's span is its child
            fields.append(f"{TRACEPARENT}: {tp}")
        if any("\r" in f or "\n" in f for f in fields):  # h11 lets none through from a client; never forward one
            raise httpx.LocalProtocolError("a header of the decoder request holds a line break")
        request = "\r\n".join([f"POST {path} HTTP/1.1", *fields, "", ""]).encode("latin-1", "replace") + body
        conn = self._checkout(url)
        if conn is not None:
            try:
                return await self._exchange(url, conn, request)
            except _Stale:
                pass
        port = parts.port or (443 if parts.scheme == "https" else 80)
        tls = self._tls_context() if parts.scheme == "https" else None
        try:
            async with asyncio.timeout(self.timeout):
                conn = await asyncio.open_connection(host, port, ssl=tls, limit=MAX_HEAD_BYTES)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {url} within {self.timeout:g} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {url}: {exc.strerror or exc}") from None
        try:
            return await self._exchange(url, conn, request)
        except _Stale as exc:
            raise httpx.RemoteProtocolError(f"{url} closed the connection without answering") from exc

    async def _exchange(self, url: str, conn: Conn, request: bytes) -> DecoderResponse:
        reader, writer = conn
        try:
            writer.write(request)
            async with asyncio.timeout(self.timeout):
                await writer.drain()
                raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            writer.close()
            if not exc.partial:
                raise _Stale from None
            raise httpx.RemoteProtocolError(f"{url} closed the connection within its answer's head") from None
        except asyncio.LimitOverrunError:
            writer.close()
            raise httpx.RemoteProtocolError(f"{url} sent an answer head over {MAX_HEAD_BYTES} bytes") from None
        except TimeoutError:
            writer.close()
            raise httpx.ReadTimeout(f"{url} did not answer within {self.timeout:g} s") from None
        except (ConnectionError, OSError) as exc:
            writer.close()
            raise _Stale from exc
        except BaseException:  # cancelled: nobody will read this answer
            writer.close()
            raise
        try:
            return DecoderResponse(self, url, conn, raw)
        except httpx.RemoteProtocolError:
            writer.close()
            raise

    def _checkout(self, url: str) -> Conn | None:
        idle = self._idle.get(url)
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    def release(self, url: str, conn: Conn) -> None:
        """A connection whose answer was read to its end: kept for the next request to that decoder."""
        idle = self._idle.setdefault(url, [])
        if len(idle) < MAX_IDLE_PER_DECODER and not conn[1].is_closing():
            idle.append(conn)
        else:
            conn[1].close()

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = httpx.create_ssl_context()  # the trust httpx gives the proxy's other calls
        return self._tls

    def close(self) -> None:
        """Close every idle connection (answers being read close theirs when they end)."""
        for idle in self._idle.values():
            for _, writer in idle:
                writer.close()
        self._idle.clear()


class _Stale(Exception):
    """The connection failed before any byte of an answer."""


class DecoderResponse:
    """A decoder's answer: its status and headers, then its body as lines (`aiter_lines`) or whole (`aread`)."""

    def __init__(self, client: DecoderHTTP, url: str, conn: Conn, raw_head: bytes) -> None:
        self._client, self.url, self._conn = client, url, conn
        lines = raw_head[:-4].split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise httpx.RemoteProtocolError(f"{url} sent a malformed status line {lines[0][:80]!r}")
        self.status_code = int(status[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise httpx.RemoteProtocolError(f"{url} sent a malformed header line {line[:80]!r}")
            headers[name.lower()] = value.strip()
        self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        length = headers.get(b"content-length")
        if length is not None and not (length.isdigit() and len(length) <= 18):
            raise httpx.RemoteProtocolError(f"{url} sent content-length {length[:40]!r}")
        self._length = None if length is None or self._chunked else int(length)
        if self._length is None and not self._chunked and self.status_code in (204, 304):
            self._length = 0
        self._keep = (status[0] == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
                      and (self._chunked or self._length is not None))
        self._done = False  # the body was read to its end

    async def _read(self, op: str, coro: Awaitable[bytes]) -> bytes:
        try:
            async with asyncio.timeout(self._client.timeout):
                return await coro
        except TimeoutError:
            raise httpx.ReadTimeout(f"{self.url} sent nothing for {self._client.timeout:g} s") from None
        except asyncio.IncompleteReadError:
            raise httpx.RemoteProtocolError(f"{self.url} closed the connection within the body ({op})") from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError(f"{self.url} sent a {op} line over the limit") from None
        except (ConnectionError, OSError) as exc:
            raise httpx.ReadError(f"{self.url}: {exc}") from None

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body's bytes as they come; at its end the connection goes back to the pool (or is closed)."""
        reader = self._conn[0]
        if self._chunked:
            while True:
                size_line = await self._read("chunk size", reader.readuntil(b"\r\n"))
                size_text = size_line.split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"{self.url} sent a bad chunk size {size_text[:20]!r}") from None
                if size < 0 or size > MAX_LINE_BYTES:
                    raise httpx.RemoteProtocolError(f"{self.url} sent a chunk of {size} bytes")
                if size == 0:
                    while (await self._read("trailer", reader.readuntil(b"\r\n"))) != b"\r\n":
                        pass
                    break
                data = await self._read("chunk", reader.readexactly(size + 2))
                if data[-2:] != b"\r\n":
                    raise httpx.RemoteProtocolError(f"{self.url} sent a chunk without its CRLF")
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left:
                data = await self._read("body", reader.readexactly(min(left, _READ)))
                left -= len(data)
                yield data
        else:
            while data := await self._read("body", reader.read(_READ)):
                yield data
        self._done = True
        if self._keep:
            self._client.release(self.url, self._conn)
        else:
            self._conn[1].close()

    async def aiter_lines(self) -> AsyncIterator[bytes]:
        """The body split at newlines (without them); a line over MAX_LINE_BYTES is a RemoteProtocolError."""
        rest = b""
        async for piece in self._pieces():
            lines = (rest + piece).split(b"\n")
            rest = lines.pop()
            if len(rest) > MAX_LINE_BYTES:
                raise httpx.RemoteProtocolError(f"{self.url} sent a line over {MAX_LINE_BYTES} bytes")
            for line in lines:
                yield line.removesuffix(b"\r")
        if rest:
            yield rest.removesuffix(b"\r")

    async def aread(self) -> bytes:
        """The whole body (error answers): over MAX_ERROR_BODY_BYTES is a RemoteProtocolError."""
        body = bytearray()
        async for piece in self._pieces():
            body += piece
            if len(body) > MAX_ERROR_BODY_BYTES:
                raise httpx.RemoteProtocolError(f"{self.url} sent an answer over {MAX_ERROR_BODY_BYTES} bytes")
        return bytes(body)

    async def aclose(self) -> None:
        """Close the connection unless the body was read to its end (it then went back to the pool)."""
        if not self._done:
            self._done = True
            self._conn[1].close()
