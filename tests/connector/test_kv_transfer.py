"""The K/V hand-off on the connector wire: a KVStore served by a KVServer, fetched by a KVClient.

Hostile producers are in test_kv_hostile.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zmq

from connector.control.security import CurveConfig
from connector.control.wire import MAX_FRAMES, decode_message, encode_message
from connector.tensors.errors import KVUnavailable
from connector.tensors.kv_client import KVClient
from connector.tensors.kv_server import KVServer
from connector.tensors.kv_store import KVStore
from epd_contracts.ec import ErrorReply, GetRequest, PingRequest, Pong
from epd_contracts.kv import KVChoice, KVGetReply, KVGetRequest, KVLayout
from tests.connector.kv_factories import CHOICES, GUARD_S, LAYOUT, layout, make_blocks, serving, waited_s


@pytest.fixture
def client() -> Any:
    c = KVClient()
    yield c
    c.close()


def raw_exchange(address: str, frames: list[Any]) -> list[bytes]:
    """Send raw frames on a fresh DEALER and return the reply's frames."""
    dealer: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        dealer.send_multipart(frames)
        assert dealer.poll(int(GUARD_S * 1000)), "the KV server did not answer"
        return dealer.recv_multipart()
    finally:
        dealer.close()


# round trips


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_is_exact_with_a_partial_last_block(client: KVClient, dtype: str) -> None:
    lay = layout(dtype=dtype)
    blocks = make_blocks(lay, 10)  # 3 blocks of 4: the last holds 2 positions
    store = KVStore(1 << 20, 60)
    assert store.put("req-1:0", lay, 10, blocks, CHOICES)
    with serving(store) as server:
        got = client.fetch(server.address, "req-1:0", lay, timeout=GUARD_S)
        assert (got.num_tokens, got.num_blocks, got.first_block) == (10, 3, 0)
        assert got.blocks.dtype == blocks.dtype and got.blocks.shape == (3, *lay.block_shape)
        assert torch.equal(got.blocks, blocks) and got.choices == CHOICES
        assert server.stats()["blocks_sent"] == 3 and server.stats()["bytes_sent"] == blocks.nbytes


def test_a_get_leaves_the_entry_for_a_retry(client: KVClient) -> None:
    store = KVStore(1 << 20, 60)
    blocks = make_blocks(LAYOUT, 5)
    store.put("k", LAYOUT, 5, blocks, CHOICES[:1])
    with serving(store) as server:
        for _ in range(2):
            assert torch.equal(client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S).blocks, blocks)
    assert store.stats()["hits"] == 2 and store.stats()["items"] == 1


def test_first_block_sends_only_the_rest(client: KVClient) -> None:
    store = KVStore(1 << 20, 60)
    blocks = make_blocks(LAYOUT, 16)  # 4 full blocks
    store.put("k", LAYOUT, 16, blocks, CHOICES)
    block_nbytes = blocks[0].nbytes
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, first_block=3, timeout=GUARD_S)
        assert got.first_block == 3 and got.num_blocks == 4 and torch.equal(got.blocks, blocks[3:])
        assert server.stats()["blocks_sent"] == 1 and server.stats()["bytes_sent"] == block_nbytes
        frames = raw_exchange(server.address, encode_message(KVGetRequest(req_id=5, key="k", layout=LAYOUT,
                                                                          first_block=2)))
        assert len(frames) == 1 + 2 and all(len(f) == block_nbytes for f in frames[1:])
        assert torch.equal(client.fetch(server.address, "k", LAYOUT, first_block=4, timeout=GUARD_S).blocks,
                           blocks[4:])  # all held already: found, no frames
        with pytest.raises(KVUnavailable, match="past the 4 held"):
            client.fetch(server.address, "k", LAYOUT, first_block=5, timeout=GUARD_S)


def test_a_prompt_of_more_blocks_than_an_ec_reply_has_frames_travels_whole(client: KVClient) -> None:
    tiny = KVLayout(fingerprint="t", num_layers=1, kv_heads=1, head_dim=1, block_size=1, dtype="float32")
    num_blocks = MAX_FRAMES + 100
    blocks = torch.arange(num_blocks * 2, dtype=torch.float32).reshape(num_blocks, *tiny.block_shape)
    store = KVStore(1 << 20, 60)
    store.put("long", tiny, num_blocks, blocks, CHOICES)
    with serving(store) as server:
        assert torch.equal(client.fetch(server.address, "long", tiny, timeout=GUARD_S).blocks, blocks)


# the store's bounds


def test_entries_expire_ttl_after_their_put(client: KVClient) -> None:
    now = [100.0]
    store = KVStore(1 << 20, ttl_s=5.0, clock=lambda: now[0])
    store.put("k", LAYOUT, 4, make_blocks(LAYOUT, 4), CHOICES)
    now[0] = 104.9
    assert store.get("k") is not None
    now[0] = 105.0
    with serving(store) as server, pytest.raises(KVUnavailable, match="not found"):
        client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
    assert {k: store.stats()[k] for k in ("items", "bytes", "expired", "misses")} == {
        "items": 0, "bytes": 0, "expired": 1, "misses": 1}


def test_a_zero_ttl_holds_nothing() -> None:
    store = KVStore(1 << 20, ttl_s=0)
    assert store.put("k", LAYOUT, 4, make_blocks(LAYOUT, 4), CHOICES)
    assert store.get("k") is None and store.stats()["expired"] == 1


def test_the_byte_bound_evicts_the_oldest_and_rejects_what_cannot_fit() -> None:
    one = make_blocks(LAYOUT, 4)  # one block
    store = KVStore(max_bytes=2 * one.nbytes, ttl_s=60)
    for key in ("a", "b", "c"):
        assert store.put(key, LAYOUT, 4, make_blocks(LAYOUT, 4), CHOICES)
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert not store.put("b", LAYOUT, 12, make_blocks(LAYOUT, 12), CHOICES)  # 3 blocks: over the whole bound
    stats = store.stats()
    assert store.get("b") is None and store.get("c") is not None  # the refused put left nothing under its key
    assert (stats["items"], stats["bytes"], stats["evicted"], stats["rejected"]) == (1, one.nbytes, 1, 1)


def test_a_put_replaces_what_the_key_held(client: KVClient) -> None:
    store = KVStore(1 << 20, 60)
    store.put("k", LAYOUT, 12, make_blocks(LAYOUT, 12), CHOICES)
    newer = make_blocks(LAYOUT, 5)
    store.put("k", LAYOUT, 5, newer, [KVChoice(first_token=1)])
    assert store.stats()["items"] == 1 and store.stats()["bytes"] == newer.nbytes
    with serving(store) as server:
        got = client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
    assert torch.equal(got.blocks, newer) and got.num_tokens == 5 and got.choices == [KVChoice(first_token=1)]


@pytest.mark.parametrize("bad", [
    {"blocks": make_blocks(LAYOUT, 8).float()},  # not the layout's dtype
    {"blocks": make_blocks(layout(kv_heads=4), 8)},  # not the layout's shape
    {"blocks": make_blocks(LAYOUT, 8).transpose(3, 4).contiguous().transpose(3, 4)},  # not contiguous
    {"num_tokens": 9},  # more positions than 2 blocks of 4
    {"num_tokens": 4},  # fits in one block: the second would be empty
    {"choices": []},
    {"choices": [KVChoice(first_token=1)] * 129},
    {"key": "no spaces"},
    {"layout": layout(dtype="complex64")},
])
def test_a_put_breaking_the_contract_is_a_value_error(bad: dict[str, Any]) -> None:
    args: dict[str, Any] = {"key": "k", "layout": LAYOUT, "num_tokens": 8, "blocks": make_blocks(LAYOUT, 8),
                            "choices": CHOICES, **bad}
    store = KVStore(1 << 20, 60)
    with pytest.raises(ValueError):
        store.put(**args)
    assert store.stats()["items"] == 0


# refusals


@pytest.mark.parametrize("field, value", [("fingerprint", "other-model"), ("kv_heads", 4), ("dtype", "float16"),
                                          ("block_size", 8), ("num_layers", 3), ("head_dim", 16)])
def test_a_layout_other_than_the_held_one_is_refused(client: KVClient, field: str, value: object) -> None:
    store = KVStore(1 << 20, 60)
    store.put("k", LAYOUT, 8, make_blocks(LAYOUT, 8), CHOICES)
    asked = layout(**{field: value})
    with serving(store) as server:
        with pytest.raises(KVUnavailable, match=f"layout differs: {field} "):
            client.fetch(server.address, "k", asked, timeout=GUARD_S)
        frames = raw_exchange(server.address, encode_message(KVGetRequest(req_id=3, key="k", layout=asked)))
        header, buffers = decode_message(frames)
        assert isinstance(header, KVGetReply) and not header.found and field in header.error and buffers == []
        assert server.stats()["blocks_sent"] == 0 and server.stats()["kv_gets_refused"] == 2


def test_a_reply_over_either_sides_byte_limit_is_refused(client: KVClient) -> None:
    store = KVStore(1 << 20, 60)
    blocks = make_blocks(LAYOUT, 8)
    store.put("k", LAYOUT, 8, blocks, CHOICES)
    with serving(store, max_reply_bytes=blocks[0].nbytes) as server:
        with pytest.raises(KVUnavailable, match="over the"):
            client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
        assert client.fetch(server.address, "k", LAYOUT, first_block=1, timeout=GUARD_S).blocks.shape[0] == 1
    with serving(store) as server:
        small = KVClient(max_reply_bytes=blocks[0].nbytes)
        try:
            with pytest.raises(KVUnavailable, match="over the consumer cap"):
                small.fetch(server.address, "k", LAYOUT, timeout=GUARD_S)
            assert torch.equal(small.fetch(server.address, "k", LAYOUT, first_block=1, timeout=GUARD_S).blocks,
                               blocks[1:])
        finally:
            small.close()


def test_the_server_keeps_serving_after_garbage(client: KVClient) -> None:
    store = KVStore(1 << 20, 60)
    blocks = make_blocks(LAYOUT, 8)
    store.put("k", LAYOUT, 8, blocks, CHOICES)
    request = encode_message(KVGetRequest(req_id=4, key="k", layout=LAYOUT))[0]
    with serving(store) as server:
        for frames in ([b"\x00garbage"], [request, b"a tensor frame"], [request[:-3]],
                       encode_message(GetRequest(req_id=4, hashes=["h"]))):
            header, _ = decode_message(raw_exchange(server.address, frames))
            assert isinstance(header, ErrorReply) and header.message and "internal" not in header.message
        assert isinstance(decode_message(raw_exchange(server.address, encode_message(PingRequest(req_id=9))))[0], Pong)
        assert torch.equal(client.fetch(server.address, "k", LAYOUT, timeout=GUARD_S).blocks, blocks)
        assert server.stats()["bad_messages"] == 4


# CURVE


def keypair() -> tuple[bytes, bytes]:
    public, secret = zmq.curve_keypair()
    return secret, public


@pytest.mark.parametrize("who", ["plaintext", "wrong_server_key", "not_allowed"])
def test_an_unauthenticated_client_gets_kv_unavailable_within_its_timeout(who: str) -> None:
    allowed = keypair()
    server_curve = CurveConfig(*keypair(), allowed_clients=frozenset({allowed[1]}))
    store = KVStore(1 << 20, 60)
    blocks = make_blocks(LAYOUT, 8)
    store.put("k", LAYOUT, 8, blocks, CHOICES)
    curves = {"plaintext": None, "wrong_server_key": CurveConfig(*allowed, server_key=keypair()[1]),
              "not_allowed": CurveConfig(*keypair(), server_key=server_curve.public_key)}
    with serving(store, server_curve) as server:
        good, bad = KVClient(CurveConfig(*allowed, server_key=server_curve.public_key)), KVClient(curves[who])
        try:
            assert torch.equal(good.fetch(server.address, "k", LAYOUT, timeout=GUARD_S).blocks, blocks)
            with pytest.raises(KVUnavailable, match="no reply") as raised:
                bad.fetch(server.address, "k", LAYOUT, timeout=0.5)
            assert waited_s(raised.value) <= 0.5  # the wait it asked for, within its timeout
        finally:
            good.close()
            bad.close()
        assert server.stats()["kv_gets_served"] == 1


def test_a_server_that_cannot_bind_raises_from_start() -> None:
    store = KVStore(1 << 20, 60)
    with serving(store) as server, pytest.raises(zmq.ZMQError):
        KVServer(store, bind=server.address).start()
