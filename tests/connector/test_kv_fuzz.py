"""Property-based fuzzing of one live KVServer: random and mutated requests are answered, and it keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.control.wire import MAGIC_VERSION, decode_message, encode_message
from connector.tensors.kv_client import KVClient
from connector.tensors.kv_server import KVServer
from connector.tensors.kv_store import KVStore
from epd_contracts.ec import ErrorReply, Pong
from epd_contracts.kv import KVGetReply, KVGetRequest
from tests.connector.kv_factories import CHOICES, GUARD_S, LAYOUT, make_blocks

FUZZ = settings(deadline=None, max_examples=200, database=None)
BLOCKS = make_blocks(LAYOUT, 10)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=16) | st.binary(max_size=16),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=12)
LAYOUTS = st.fixed_dictionaries({}, optional={
    name: st.just(getattr(LAYOUT, name)) | VALUES for name in LAYOUT.__struct_fields__})
HEADERS = st.fixed_dictionaries(
    {"op": st.sampled_from(["kv_get", "ping", "kv_reply", "get"]) | VALUES, "req_id": st.integers(-1, 2**64 - 1)},
    optional={"key": st.sampled_from(["k", "missing", "", "a b", "x" * 200]) | VALUES, "layout": LAYOUTS | VALUES,
              "first_block": st.integers(-2, 5) | VALUES})


class Live:
    def __init__(self) -> None:
        self.store = KVStore(1 << 20, 3600)
        self.store.put("k", LAYOUT, 10, BLOCKS, CHOICES)
        self.server = KVServer(self.store).start()
        self.client = KVClient()
        self.dealer: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.server.address)

    def exchange(self, frames: list[bytes]) -> None:
        """Send raw frames; the server must answer with an error or a well-formed reply."""
        self.dealer.send_multipart(frames)
        assert self.dealer.poll(int(GUARD_S * 1000)), f"the KV server stopped answering after {frames!r:.300}"
        header, buffers = decode_message(self.dealer.recv_multipart(), max_frames=1 << 20)
        assert isinstance(header, (ErrorReply, KVGetReply, Pong))
        if isinstance(header, ErrorReply):
            assert header.message and not header.message.startswith("internal error"), header.message
        if isinstance(header, KVGetReply) and header.found:
            assert [bytes(b) for b in buffers] == [bytes(b.view(torch.uint8).flatten().numpy()) for b in
                                                    BLOCKS[header.first_block:]]

    def still_serves(self) -> None:
        assert torch.equal(self.client.fetch(self.server.address, "k", LAYOUT, timeout=GUARD_S).blocks, BLOCKS)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    state = Live()
    yield state
    state.dealer.close()
    state.client.close()
    state.server.close()


def request(first_block: int = 0) -> list[bytes]:
    return [bytes(f) for f in encode_message(KVGetRequest(req_id=7, key="k", layout=LAYOUT, first_block=first_block))]


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=6))
def test_random_multipart_messages_are_answered(live: Live, frames: list[bytes]) -> None:
    live.exchange(frames)
    live.still_serves()


@FUZZ
@given(header=HEADERS, extra=st.lists(st.binary(max_size=32), max_size=2))
def test_random_headers_are_answered(live: Live, header: Any, extra: list[bytes]) -> None:
    live.exchange([MAGIC_VERSION + msgpack.packb(header), *extra])
    live.still_serves()


@FUZZ
@given(first_block=st.integers(0, 4), at=st.integers(0, 1 << 16), flip=st.integers(1, 255))
def test_requests_with_a_flipped_byte_are_answered(live: Live, first_block: int, at: int, flip: int) -> None:
    frame = bytearray(request(first_block)[0])
    frame[at % len(frame)] ^= flip
    live.exchange([bytes(frame)])
    live.still_serves()
