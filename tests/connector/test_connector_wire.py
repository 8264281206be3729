"""Wire format: round trips with awkward tensors and rejection of malformed messages."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

import connector.control.wire
from connector.control.wire import (
    MAGIC_VERSION,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    WireError,
    apply_socket_limits,
    decode_message,
    encode_message,
    peek_req_id,
)
from connector.tensors.frames import WireItem, tensor_buffer, tensor_from_frame
from connector.tensors.replies import get_reply, parse_get_reply
from epd_contracts.ec import GetReply, PingRequest, Pong
from epd_contracts.embeddings import ImageFeatures


def frame(header_bytes: bytes) -> bytes:
    """The first frame of a wire v3 message: magic and version, then the raw msgpack header."""
    return MAGIC_VERSION + header_bytes


def make_frames(header: Any, tensors: Sequence[bytes] = ()) -> list[bytes]:
    """Hand-built message with a raw header, to reach checks that encode_message would not produce."""
    return [frame(msgpack.packb(header)), *tensors]


PING = msgpack.packb({"op": "ping", "req_id": 1})


def round_trip(tensors: list[torch.Tensor]) -> tuple[list[bytes | memoryview], list[torch.Tensor]]:
    items = [WireItem(ImageFeatures(t)).item(f"h{i}", frame=i) for i, t in enumerate(tensors)]
    frames = encode_message(GetReply(req_id=7, items=items), [tensor_buffer(t) for t in tensors])
    first = bytes(frames[0])  # magic, version and header share the first frame; the header is plain msgpack
    assert first.startswith(MAGIC_VERSION) and msgpack.unpackb(first[len(MAGIC_VERSION):])["op"] == "get_reply"
    # bytes() mimics what arrives off a socket, so nothing aliases the sender's tensors
    header, buffers = decode_message([bytes(f) for f in frames])
    assert isinstance(header, GetReply) and header.req_id == 7
    found = parse_get_reply(header, buffers)
    return frames, [found[f"h{i}"].embeds for i in range(len(tensors))]


AWKWARD = {
    "float32": torch.randn(5, 64),
    "float16": torch.randn(3, 8).half(),
    "bfloat16": torch.randn(4, 16).to(torch.bfloat16),
    "empty": torch.empty(0, 64),
    "transposed": torch.randn(16, 4).T,
    "one_dim": torch.arange(10, dtype=torch.float32),
    "one_by_one": torch.tensor([[3.5]]),
}


@pytest.mark.parametrize("name", list(AWKWARD))
def test_round_trip_preserves_dtype_shape_and_values(name: str) -> None:
    t = AWKWARD[name]
    frames, (back,) = round_trip([t])
    assert len(frames) == 2  # magic+header, one tensor frame
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_round_trip_of_several_tensors_keeps_one_frame_each() -> None:
    tensors = list(AWKWARD.values())
    frames, back = round_trip(tensors)
    assert len(frames) == 1 + len(tensors)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, back, strict=True))


def test_get_reply_round_trips_encoder_outputs_and_not_found_items() -> None:
    out = ImageFeatures(torch.randn(6, 32).to(torch.bfloat16), (1, 4, 6))
    header, tensors = get_reply(3, ["h1", "nope"], {"h1": WireItem(out)})
    assert len(tensors) == 1 and isinstance(tensors[0], memoryview) and tensors[0].nbytes == out.nbytes
    frames = [bytes(f) for f in encode_message(header, tensors)]
    assert len(frames) == 2
    reply, buffers = decode_message(frames)
    assert isinstance(reply, GetReply)
    found = parse_get_reply(reply, buffers)
    assert list(found) == ["h1"]
    assert torch.equal(found["h1"].embeds, out.embeds) and found["h1"].grid_thw == (1, 4, 6)


def test_writable_frame_buffer_is_used_without_copy() -> None:
    buf = bytearray(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    t = tensor_from_frame(memoryview(buf), "float32", [2, 2])
    buf[0:4] = torch.tensor([9.0]).numpy().tobytes()
    assert t[0, 0].item() == 9.0  # the tensor aliases the frame memory


GOOD_SPEC = {"mm_hash": "h", "found": True, "num_tokens": 2, "dtype": "float32", "shape": [2, 2], "frame": 0}
MALFORMED: dict[str, list[bytes]] = {
    "too_few_frames": [],
    "empty_first_frame": [b""],
    "truncated_magic": [MAGIC_VERSION[:3]],
    "missing_header": [MAGIC_VERSION],
    "wrong_magic": [b"NOPE" + MAGIC_VERSION[4:] + PING],
    "wrong_version": [MAGIC_VERSION[:4] + bytes([1]) + PING],
    "future_version": [MAGIC_VERSION[:4] + bytes([MAGIC_VERSION[4] + 1]) + PING],
    "v1_message": [MAGIC_VERSION[:4] + bytes([1]), PING],  # magic and header in separate frames
    "v2_message": [MAGIC_VERSION[:4] + bytes([2]) + PING],  # v2 headers were untyped maps
    "magic_then_header_frame": [MAGIC_VERSION, PING],
    "bad_msgpack": [frame(b"\xc1\xff\x00")],
    "truncated_msgpack": [frame(PING[:-2])],
    "trailing_bytes_after_header": [frame(PING + b"\x00")],
    "header_not_map": make_frames([1, 2, 3]),
    "unknown_op": make_frames({"op": "format_disk", "req_id": 1}),
    "missing_req_id": make_frames({"op": "ping"}),
    "bool_req_id": make_frames({"op": "ping", "req_id": True}),
    "items_not_list": make_frames({"op": "get_reply", "req_id": 1, "items": "x"}),
    "unknown_dtype": make_frames({"op": "get_reply", "req_id": 1, "items": [{**GOOD_SPEC, "dtype": "complex64"}]}, [bytes(16)]),
    "negative_dim": make_frames({"op": "get_reply", "req_id": 1, "items": [{**GOOD_SPEC, "shape": [-2, -2]}]}, [bytes(16)]),
    "shape_not_list": make_frames({"op": "get_reply", "req_id": 1, "items": [{**GOOD_SPEC, "shape": "2x2"}]}, [bytes(16)]),
    "length_mismatch": make_frames({"op": "get_reply", "req_id": 1, "items": [GOOD_SPEC]}, [bytes(15)]),
    "extra_frame": make_frames({"op": "get_reply", "req_id": 1, "items": [GOOD_SPEC]}, [bytes(16), bytes(16)]),
    "missing_frame": make_frames({"op": "get_reply", "req_id": 1, "items": [GOOD_SPEC]}),
    "frame_index_out_of_range": make_frames({"op": "get_reply", "req_id": 1, "items": [{**GOOD_SPEC, "frame": 5}]}, [bytes(16)]),
    "hash_too_long": make_frames({"op": "has", "req_id": 1, "hashes": ["h" * 257]}),
    "negative_seq": make_frames({"op": "snapshot_reply", "req_id": 1, "epoch": "e", "seq": -1, "hashes": []}),
    "unknown_field": make_frames({"op": "ping", "req_id": 1, "pad": 0}),
    "frame_without_spec": make_frames({"op": "get_reply", "req_id": 1, "items": [{"mm_hash": "h", "frame": 0}]},
                                      [bytes(16)]),
    "tensor_frame_on_a_request": make_frames({"op": "ping", "req_id": 1}, [bytes(16)]),
    "repeated_frame_index": make_frames(
        {"op": "get_reply", "req_id": 1, "items": [GOOD_SPEC, GOOD_SPEC]}, [bytes(16), bytes(16)]
    ),
    "oversized_shape": make_frames(
        {"op": "get_reply", "req_id": 1, "items": [{**GOOD_SPEC, "shape": [1 << 20, 1 << 20]}]}, [bytes(16)]
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_message_raises_wire_error(name: str) -> None:
    with pytest.raises(WireError):
        decode_message(MALFORMED[name])


def test_wire_error_is_a_value_error_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match=r"'complex64' - at `\$.items\[0\].dtype`"):
        decode_message(MALFORMED["unknown_dtype"])


def test_oversized_declared_tensor_is_rejected_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_alloc(*args: object, **kwargs: object) -> None:
        raise AssertionError("allocated for an oversized tensor")

    monkeypatch.setattr(torch, "empty", no_alloc)
    monkeypatch.setattr(torch, "frombuffer", no_alloc)
    with pytest.raises(WireError, match="over the"):
        tensor_from_frame(b"", "float32", [1 << 40])
    with pytest.raises(WireError, match="over the"):
        tensor_from_frame(b"", "float32", [0, 1 << 62])  # zero elements, absurd dim
    with pytest.raises(WireError, match="over the"):
        decode_message(MALFORMED["oversized_shape"])


def test_tensor_from_frame_rejects_length_mismatch() -> None:
    with pytest.raises(WireError, match="needs 16"):
        tensor_from_frame(bytes(12), "float32", [2, 2])


def test_get_reply_with_inconsistent_item_fields_is_rejected() -> None:
    item = {**GOOD_SPEC, "num_tokens": 3, "grid_thw": None}
    reply, buffers = decode_message(make_frames({"op": "get_reply", "req_id": 1, "items": [item]}, [bytes(16)]))
    assert isinstance(reply, GetReply)
    with pytest.raises(WireError, match="num_tokens"):
        parse_get_reply(reply, buffers)


def deep(depth: int, leaf: bytes = b"\x01") -> bytes:
    """Raw msgpack of `depth` nested one-element arrays (packb refuses to nest this deep)."""
    return b"\x91" * depth + leaf


def raw_map(**fields: bytes) -> bytes:
    """Raw msgpack map whose values are already-packed bytes."""
    return bytes([0x80 | len(fields)]) + b"".join(msgpack.packb(k) + v for k, v in fields.items())


def test_too_many_frames_are_rejected_before_any_is_read() -> None:
    untouchable: list[Any] = [object()] * MAX_FRAMES  # as_buffer() on these would raise TypeError
    with pytest.raises(WireError, match=f"1 to {MAX_FRAMES} frames"):
        decode_message([frame(PING), *untouchable])


def test_oversized_header_is_rejected_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    header = msgpack.packb({"op": "ping", "req_id": 3, "pad": "x" * MAX_HEADER_BYTES})

    class NoDecode:
        def decode(self, *args: object) -> None:
            raise AssertionError("decoded an oversized header")

    monkeypatch.setattr(connector.control.wire, "_DECODER", NoDecode())
    monkeypatch.setattr(connector.control.wire, "_PEEK", NoDecode())
    with pytest.raises(WireError, match="over the 1048576-byte limit"):
        decode_message([frame(header)])
    assert peek_req_id([frame(header)]) == -1


REPLY, UINT8 = msgpack.packb("get_reply"), msgpack.packb("uint8")
NESTED = {
    "past_msgpack_stack": deep(5000),
    "deep_op": raw_map(op=deep(1020), req_id=b"\x01"),
    "deep_req_id": raw_map(op=msgpack.packb("ping"), req_id=deep(1020)),
    "deep_shape": raw_map(op=REPLY, req_id=b"\x01", items=b"\x91" + raw_map(dtype=UINT8, shape=deep(1015), frame=b"\x00")),
    "deep_dtype": raw_map(op=REPLY, req_id=b"\x01", items=b"\x91" + raw_map(dtype=deep(1015), shape=b"\x91\x01", frame=b"\x00")),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_deeply_nested_header_is_a_wire_error_with_a_short_message(name: str) -> None:
    with pytest.raises(WireError) as info:
        decode_message([frame(NESTED[name]), bytes(1)])
    assert len(str(info.value)) < 300
    peek_req_id([frame(NESTED[name])])  # best effort, but never raises


def test_huge_values_are_echoed_briefly_and_ext_types_are_refused() -> None:
    with pytest.raises(WireError, match="Invalid value") as info:
        decode_message(make_frames({"op": "x" * 500_000, "req_id": 1}))
    assert len(str(info.value)) < 300
    with pytest.raises(WireError, match="got `ext`"):
        decode_message(make_frames({"op": "ping", "req_id": msgpack.ExtType(1, b"data")}))


def test_huge_magic_frame_is_not_copied() -> None:
    first = bytes(16 << 20) + PING  # 16 MiB where the magic should be, then a header
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="bad magic"):
            decode_message([first])
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_apply_socket_limits_sets_maxmsgsize() -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        apply_socket_limits(sock, 4096)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        with pytest.raises(ValueError, match=">= 0"):
            apply_socket_limits(sock, -1)
    finally:
        sock.close(linger=0)


def test_router_drops_a_peer_over_its_message_size_limit_and_serves_others() -> None:
    guard_ms = 5000
    ctx: zmq.Context[zmq.Socket[Any]] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    apply_socket_limits(router, 1024)
    monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (big, small):
            sock.connect(f"tcp://127.0.0.1:{port}")
        big.send_multipart([frame(bytes(2048))])
        assert monitor.poll(guard_ms), "the oversized sender was not disconnected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        small.send_multipart(encode_message(PingRequest(req_id=11)))
        assert router.poll(guard_ms)
        identity, *frames = router.recv_multipart()
        assert decode_message(frames)[0] == PingRequest(req_id=11)  # not the oversized message
        router.send_multipart([identity, *encode_message(Pong(req_id=11))])
        assert small.poll(guard_ms) and isinstance(decode_message(small.recv_multipart())[0], Pong)
        assert not router.poll(0)
    finally:
        router.disable_monitor()
        for sock in (monitor, big, small, router):
            sock.close(linger=0)


def test_producer_side_byte_view_shares_the_stored_tensor_memory() -> None:
    item = WireItem(ImageFeatures(torch.zeros(4, 3, dtype=torch.bfloat16)))
    view = item.buffers[0]
    assert view.nbytes == item.nbytes and item.buffers[0] is view  # made once per item
    item.features.embeds[0, 0] = 1.5
    assert bytes(view[:2]) == torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
