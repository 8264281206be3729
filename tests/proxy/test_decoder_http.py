"""proxy/decoder_http.py against scripted decoders on loopback: bodies of every framing, keep-alive and its
expiry, a stream closed early, and every bound and failure as the httpx error the proxy handles."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from proxy.decoder_http import MAX_HEAD_BYTES, MAX_LINE_BYTES, DecoderHTTP

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LINES = [b'{"type":"delta","text":"a"}', b'{"type":"delta","text":"b"}', b'{"type":"done"}']


class Decoder:
    """An asyncio server answering every request on a connection with `script`; counts connections."""

    def __init__(self, script: Script) -> None:
        self.script, self.connections, self.requests = script, 0, 0
        self.closed_by_client = asyncio.Event()
        self.handlers: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                await self.script(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


@asynccontextmanager
async def decoder(script: Script) -> AsyncIterator[tuple[Decoder, str]]:
    d = Decoder(script)
    server = await asyncio.start_server(d._serve, "127.0.0.1", 0)
    try:
        yield d, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in d.writers:
            writer.close()
        for task in d.handlers:
            task.cancel()
        await asyncio.gather(*d.handlers, return_exceptions=True)
        await server.wait_closed()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def ndjson_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b"\n".join(LINES) + b"\n"
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(body[:10], body[10:]))
    await writer.drain()


async def read_lines(client: DecoderHTTP, url: str) -> tuple[int, list[bytes]]:
    resp = await client.post_stream(url, "/generate", b"{}", {"content-type": "application/json"})
    try:
        return resp.status_code, [line async for line in resp.aiter_lines()]
    finally:
        await resp.aclose()


async def answers(script: Script, n: int) -> tuple[list[tuple[int, list[bytes]]], int]:
    """`n` requests in a row from one client to a decoder running `script`; the answers and its connection count."""
    async with decoder(script) as (d, url):
        client = DecoderHTTP(5.0)
        got = [await read_lines(client, url) for _ in range(n)]
        client.close()
        return got, d.connections


def test_chunked_lines_come_whole_across_chunks_and_the_connection_is_reused() -> None:
    got, connections = asyncio.run(answers(ndjson_chunked, 3))
    assert got == [(200, LINES)] * 3 and connections == 1


@pytest.mark.parametrize("framing", ["content-length", "until-close"])
def test_bodies_by_length_and_until_close_are_read(framing: str) -> None:
    body = b"\r\n".join(LINES)  # CRLF line ends too

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if framing == "content-length":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\n" + body)
            writer.close()

    got, connections = asyncio.run(answers(answer, 2))
    assert got == [(200, LINES)] * 2
    assert connections == (1 if framing == "content-length" else 2)  # an HTTP/1.0 answer is never reused


def test_an_answer_closed_before_its_end_closes_the_connection() -> None:
    """How the decoder learns a generation is no longer wanted: the connection goes, it is not pooled."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"3\r\n{}\n\r\n")
        await writer.drain()
        await reader.read()  # the next bytes (EOF) show whether the client left

    async def main() -> tuple[bool, int]:
        async with decoder(endless) as (d, url):
            client = DecoderHTTP(5.0)
            resp = await client.post_stream(url, "/generate", b"{}", {})
            lines = resp.aiter_lines()
            assert await anext(lines) == b"{}"
            await resp.aclose()
            await asyncio.wait_for(d.closed_by_client.wait(), 10)  # a guard, not a wait: set when the client closed
            return d.closed_by_client.is_set(), len(client._idle.get(url, []))

    closed, idle = asyncio.run(main())
    assert closed and idle == 0


def test_a_kept_alive_connection_the_decoder_closed_is_replaced_without_an_error() -> None:
    served: dict[object, int] = {}  # connection (the client's port) -> requests it got

    async def once_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        n = served[peer] = served.get(peer, 0) + 1
        if n == 1:
            await ndjson_chunked(reader, writer)
        else:
            writer.close()  # its keep-alive timer fired as the request came: closed with no answer

    async def main() -> tuple[list[tuple[int, list[bytes]]], int, int]:
        async with decoder(once_per_connection) as (d, url):
            client = DecoderHTTP(5.0)
            got = [await read_lines(client, url)]  # the connection is pooled, its EOF not seen yet
            got.append(await read_lines(client, url))  # sent on it, no answer: sent again on a new one
            conn = client._idle[url][0]
            conn[1].close()  # a pooled connection already closed is never used
            got.append(await read_lines(client, url))
            client.close()
            return got, d.connections, d.requests

    got, connections, requests = asyncio.run(main())
    assert got == [(200, LINES)] * 3 and connections == 3 and requests == 4


def test_an_error_answer_is_read_whole() -> None:
    async def error(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b'{"error": {"message": "no", "code": "x"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))

    async def main() -> tuple[int, bytes]:
        async with decoder(error) as (_, url):
            client = DecoderHTTP(5.0)
            resp = await client.post_stream(url, "/generate", b"{}", {})
            got = resp.status_code, await resp.aread()
            client.close()
            return got

    assert asyncio.run(main()) == (400, b'{"error": {"message": "no", "code": "x"}}')


def _raw(answer: bytes) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    return script


@pytest.mark.parametrize("answer, what", [
    (b"HTTP/1.1 200 OK\r\nx: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", "head"),
    (b"SPDY/9 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n", "content-length"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n" % (MAX_LINE_BYTES + 1), "chunk size"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}XX", "chunk CRLF"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort", "truncated body"),
    (b"HTTP/1.1 200 OK\r\n", "truncated head"),
    (b"", "no answer"),
])
def test_a_malformed_or_oversized_answer_is_a_protocol_error(answer: bytes, what: str) -> None:
    async def main() -> None:
        async with decoder(_raw(answer)) as (_, url):
            await read_lines(DecoderHTTP(5.0), url)

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(main())


def test_a_line_over_the_cap_is_refused_before_it_is_held_whole() -> None:
    async def long_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\n\r\n")
        piece = b"x" * (1 << 20)
        try:
            for _ in range(MAX_LINE_BYTES // len(piece) + 2):
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            pass  # the client gave up, as it should
        writer.close()

    async def main() -> None:
        async with decoder(long_line) as (_, url):
            await read_lines(DecoderHTTP(5.0), url)

    with pytest.raises(httpx.RemoteProtocolError, match="line over"):
        asyncio.run(main())


def test_a_decoder_that_never_answers_is_a_read_timeout_and_a_closed_port_a_connect_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def main() -> None:
        async with decoder(silent) as (_, url):
            await read_lines(DecoderHTTP(0.3), url)

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(main())

    async def refused() -> None:
        async with decoder(silent) as (_, url):
            pass  # closed on exit: nothing listens there any more
        await read_lines(DecoderHTTP(5.0), url)

    with pytest.raises(httpx.ConnectError):
        asyncio.run(refused())


def test_a_header_with_a_line_break_is_never_sent() -> None:
    async def main() -> None:
        async with decoder(ndjson_chunked) as (d, url):
            try:
                await DecoderHTTP(5.0).post_stream(url, "/generate", b"{}", {"x-request-id": "a\r\nx-evil: 1"})
            finally:
                assert d.requests == 0

    with pytest.raises(httpx.LocalProtocolError):
        asyncio.run(main())
