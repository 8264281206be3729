"""A KVClient against a fake K/V producer: every malformed, inconsistent or silent answer is one KVUnavailable,
raised within the fetch's timeout, and no tensor comes back."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from connector.control.wire import encode_message
from connector.tensors.dtypes import DTYPES
from connector.tensors.errors import KVUnavailable
from connector.tensors.frames import tensor_buffer
from connector.tensors.kv_client import KVClient
from epd_contracts.ec import ErrorReply, Pong
from epd_contracts.kv import KVChoice, KVGetReply, KVGetRequest
from tests.connector.kv_factories import CHOICES, GUARD_S, LAYOUT, Answer, fake_producer, layout, make_blocks, waited_s

NUM_TOKENS = 10  # 3 blocks of LAYOUT.block_size 4
BLOCKS = make_blocks(LAYOUT, NUM_TOKENS)


def reply(request: KVGetRequest, blocks: torch.Tensor = BLOCKS, **fields: Any) -> list[Any]:
    """An honest reply to `request` from `blocks`, with `fields` overriding the header."""
    header = {"req_id": request.req_id, "key": request.key, "found": True, "layout": request.layout,
              "num_tokens": NUM_TOKENS, "num_blocks": 3, "first_block": request.first_block, "choices": CHOICES,
              **fields}
    return encode_message(KVGetReply(**header), [tensor_buffer(b) for b in blocks[request.first_block:]])


def with_values(index: int, *values: float) -> torch.Tensor:
    """BLOCKS with `values` written into block `index`, at distinct positions."""
    blocks = BLOCKS.clone()
    for i, value in enumerate(values):
        blocks[index, 1, 0, 1, 2, i] = value
    return blocks


def encoded(header: dict[str, Any], frames: list[bytes]) -> list[Any]:
    """A reply from a raw header dict, for what a KVGetReply cannot be built with."""
    return [b"EPDC\x03" + msgspec.msgpack.encode(header), *frames]


HOSTILE: dict[str, tuple[Answer, str]] = {  # case -> (the fake's answer, what the refusal names)
    "smaller frames (other block shape)": (lambda r: reply(r, make_blocks(layout(head_dim=4), NUM_TOKENS)),
                                           "frame 0 has 256 bytes"),
    "wrong dtype in the layout": (lambda r: reply(r, BLOCKS.float(), layout=layout(dtype="float32")),
                                  "dtype 'float32'"),
    "other heads in the layout": (lambda r: reply(r, make_blocks(layout(kv_heads=1), NUM_TOKENS),
                                                  layout=layout(kv_heads=1)), "kv_heads 1"),
    "other model": (lambda r: reply(r, layout=layout(fingerprint="other")), "fingerprint 'other'"),
    "frame one byte short": (lambda r: [*reply(r)[:-1], bytes(tensor_buffer(BLOCKS[2]))[:-1]], "frame 2 has 511"),
    "frame one byte long": (lambda r: [*reply(r)[:-1], bytes(tensor_buffer(BLOCKS[2])) + b"\x00"], "frame 2 has 513"),
    "too few frames": (lambda r: reply(r)[:-1], "has 2 frame"),
    "too many frames": (lambda r: [*reply(r), bytes(tensor_buffer(BLOCKS[0]))], "has 4 frame"),
    "more tokens than blocks hold": (lambda r: reply(r, num_tokens=13), "13 token.* do not fill"),
    "a block with no token": (lambda r: reply(r, num_tokens=8), "8 token.* do not fill"),
    "num_blocks past the frames": (lambda r: reply(r, num_blocks=4), "blocks 0..4"),
    "first_block past num_blocks": (lambda r: reply(r, BLOCKS[:0], first_block=4), "blocks 4..3"),
    "first_block not the asked one": (lambda r: reply(r, BLOCKS[1:], first_block=1), "asked from 0"),
    "NaN in a block": (lambda r: reply(r, with_values(1, float("nan"))), "block 1 has non-finite"),
    "inf in a block": (lambda r: reply(r, with_values(2, float("inf"))), "block 2 has non-finite"),
    "-inf in a block": (lambda r: reply(r, with_values(0, float("-inf"))), "block 0 has non-finite"),
    "inf and -inf in a block": (lambda r: reply(r, with_values(1, float("inf"), float("-inf"))),
                                "block 1 has non-finite"),
    "another key": (lambda r: reply(r, key="other"), "another request"),
    "no choices": (lambda r: reply(r, choices=[]), "0 choice"),
    "too many choices": (lambda r: reply(r, choices=[KVChoice(first_token=1)] * 129), "choices"),
    "found without a layout": (lambda r: reply(r, layout=None), "without blocks"),
    "not found with frames": (lambda r: reply(r, found=False), "without blocks"),
    "not found": (lambda r: encode_message(KVGetReply(req_id=r.req_id, key=r.key, error="not found")), "not found"),
    "an error reply": (lambda r: encode_message(ErrorReply(req_id=r.req_id, message="no")), ": no$"),
    "a pong": (lambda r: encode_message(Pong(req_id=r.req_id)), "Pong"),
    "a negative block count": (lambda r: encoded({"op": "kv_reply", "req_id": r.req_id, "key": r.key, "found": True,
                                                  "num_blocks": -1}, []), "num_blocks"),
    "an unknown field": (lambda r: encoded({"op": "kv_reply", "req_id": r.req_id, "key": r.key, "x": 1}, []),
                         "unknown field"),
}
SILENT: dict[str, Answer] = {  # answers the client cannot take as its reply: it waits out its timeout
    "another req_id": lambda r: reply(msgspec.structs.replace(r, req_id=r.req_id + 1)),
    "garbage bytes": lambda r: [b"\x00\xffgarbage", b"more"],
    "no answer": lambda r: [],
}


@pytest.fixture(scope="module")
def client() -> Iterator[KVClient]:
    c = KVClient()
    yield c
    c.close()


def test_the_honest_fake_is_fetched(client: KVClient) -> None:
    with fake_producer(reply) as address:
        got = client.fetch(address, "k", LAYOUT, timeout=GUARD_S)
        assert torch.equal(got.blocks, BLOCKS) and got.choices == CHOICES
        assert torch.equal(client.fetch(address, "k", LAYOUT, first_block=1, timeout=GUARD_S).blocks, BLOCKS[1:])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_the_largest_finite_values_are_fetched(client: KVClient, dtype: str) -> None:
    lay = layout(dtype=dtype)
    blocks = torch.full((3, *lay.block_shape), torch.finfo(DTYPES[dtype]).max, dtype=DTYPES[dtype])
    blocks[1] = torch.finfo(DTYPES[dtype]).min
    with fake_producer(lambda r: reply(r, blocks)) as address:
        assert torch.equal(client.fetch(address, "k", lay, timeout=GUARD_S).blocks, blocks)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_reply_is_kv_unavailable_at_once(client: KVClient, case: str) -> None:
    answer, why = HOSTILE[case]
    with fake_producer(answer) as address:
        with pytest.raises(KVUnavailable) as raised:
            client.fetch(address, "k", LAYOUT, timeout=GUARD_S)
        # refused for the reply's own defect when it came, not at the timeout for want of a good one ("no reply")
        assert re.search(why, raised.value.reason) and "no reply" not in raised.value.reason, raised.value.reason


@pytest.mark.parametrize("case", sorted(SILENT))
def test_a_reply_that_is_not_ours_is_kv_unavailable_within_the_timeout(client: KVClient, case: str) -> None:
    with fake_producer(SILENT[case]) as address:
        with pytest.raises(KVUnavailable, match="no reply") as raised:
            client.fetch(address, "k", LAYOUT, timeout=0.5)
        assert waited_s(raised.value) <= 0.5  # the wait the client asked for, within its timeout


def test_an_unreachable_producer_is_kv_unavailable_within_the_timeout(client: KVClient) -> None:
    for address in ("tcp://127.0.0.1:1", "not-an-endpoint"):
        with pytest.raises(KVUnavailable, match="no reply") as raised:
            client.fetch(address, "k", LAYOUT, timeout=0.5)
        assert waited_s(raised.value) <= 0.5  # the wait the client asked for, within its timeout
