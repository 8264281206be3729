"""Option E of the prefix-publishing micro-benchmark (epd_bench/prefix_publish.py): what a decoder's `stored`/`evicted`
events cost, per event in process, through a real ZeroMQ PUB/SUB pair, batched, and as the snapshot a subscriber
needs at start, after a gap or a restart."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import zmq

from connector.control.hint_index import ProducerView
from connector.control.wire import MAX_REPLY_HEADER_BYTES, decode_message, encode_message
from epd_bench.micro import median_s
from epd_contracts.ec import HEARTBEAT_S, CacheEvent, SnapshotReply

ZMTP_FRAME_OVERHEAD = 2  # bytes a ZMTP 3 short frame (< 256 bytes) adds: flags and size
BATCH_S = 0.1  # the batched variant's flush interval
PRODUCER = "tcp://10.0.0.7:5601"  # a typical advertised address (it is part of every event)
EPOCH = "9f3c1e2a7b6d4c5e"  # a producer epoch (secrets.token_hex(8), as connector/tensors/producer.py)


def make_keys(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def _event(seq: int, kind: str, hashes: list[str]) -> CacheEvent:
    return CacheEvent(producer=PRODUCER, epoch=EPOCH, seq=seq, kind=kind,  # type: ignore[arg-type]
                      hashes=hashes)


def _frame_bytes(frames: Sequence[bytes | memoryview]) -> int:
    return sum(len(f) + ZMTP_FRAME_OVERHEAD for f in frames)


def _in_process(batch: int, budget_s: float) -> dict[str, float]:
    """Per event carrying `batch` keys (0: a heartbeat): encode, decode + apply on a synced ProducerView, bytes."""
    keys = make_keys(batch, seed=1)
    kind = "stored" if batch else "heartbeat"
    view = ProducerView(PRODUCER, "")
    view.apply_snapshot(SnapshotReply(req_id=0, epoch=EPOCH, seq=0, hashes=[]))
    seq = 1 if batch else 0  # a heartbeat repeats the last seq
    raw = [bytes(f) for f in encode_message(_event(seq, kind, keys))]

    def decode_apply() -> None:
        view.seq = 0  # each round applies the same event again, in order
        event, _ = decode_message(raw)
        assert isinstance(event, CacheEvent) and view.apply_event(event)

    return {"encode_us": median_s(lambda: encode_message(_event(seq, kind, keys)), budget_s=budget_s) * 1e6,
            "decode_apply_us": median_s(decode_apply, budget_s=budget_s) * 1e6, "bytes": float(_frame_bytes(raw))}


def _zmq_pair(n: int, timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    """One-key events through a real PUB/SUB pair on loopback TCP, end to end (encode, send, ZeroMQ's I/O threads,
    receive, decode, apply): `burst` sends n then receives them; `paced` sends one and waits for it before the
    next, as sparse events go (each wakes every thread on the way). Wall and process CPU per event."""
    ctx: zmq.Context[Any] = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        for sock in (pub, sub):
            sock.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)  # as the encoders' PUB and the index's SUB do
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        pub.bind("tcp://127.0.0.1:*")
        sub.connect(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        deadline = time.monotonic() + timeout_s
        while not sub.poll(10, zmq.POLLIN):  # a SUB drops what is published before it joins: wait for a beat
            assert time.monotonic() < deadline, "subscriber did not join"
            pub.send_multipart(encode_message(_event(0, "heartbeat", [])), copy=False)
        while sub.poll(0, zmq.POLLIN):
            sub.recv_multipart()
        keys = make_keys(2 * n, seed=2)
        view = ProducerView(PRODUCER, "")
        view.apply_snapshot(SnapshotReply(req_id=0, epoch=EPOCH, seq=0, hashes=[]))

        def receive(upto: int) -> None:
            while view.seq < upto:
                assert sub.poll(int(timeout_s * 1000), zmq.POLLIN), f"only {view.seq} of {upto} events arrived"
                event, _ = decode_message(sub.recv_multipart(copy=False))
                assert isinstance(event, CacheEvent) and view.apply_event(event), "events out of order"

        def send(seq: int) -> None:
            pub.send_multipart(encode_message(_event(seq, "stored", [keys[seq - 1]])), copy=False)

        out = {}
        for mode in ("burst", "paced"):
            first = view.seq + 1
            wall, cpu = time.perf_counter(), time.process_time()
            for seq in range(first, first + n):
                send(seq)
                if mode == "paced":
                    receive(seq)
            receive(first + n - 1)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            out[mode] = {"events": n, "wall_us_per_event": round(wall / n * 1e6, 2),
                         "cpu_us_per_event": round(cpu / n * 1e6, 2)}
        assert len(view.held) == 2 * n
        return out
    finally:
        pub.close()
        sub.close()
        ctx.term()


def _snapshot(k: int, budget_s: float) -> dict[str, float]:
    """A subscriber's resync: a SnapshotReply of K keys, encoded, decoded and made the view's set."""
    keys = make_keys(k)
    raw = [bytes(f) for f in encode_message(SnapshotReply(req_id=0, epoch=EPOCH, seq=7, hashes=keys))]

    def decode_apply() -> None:
        snap, _ = decode_message(raw, max_header_bytes=MAX_REPLY_HEADER_BYTES)
        assert isinstance(snap, SnapshotReply)
        ProducerView(PRODUCER, "").apply_snapshot(snap)

    return {"keys": k, "bytes": _frame_bytes(raw),
            "encode_us": round(median_s(lambda: encode_message(SnapshotReply(req_id=0, epoch=EPOCH, seq=7, hashes=keys)),
                                        budget_s=budget_s) * 1e6, 1),
            "decode_apply_us": round(median_s(decode_apply, budget_s=budget_s) * 1e6, 1)}


def events(key_counts: list[int], churns: list[float], zmq_events: int, budget_s: float) -> dict[str, Any]:
    """Option E per churn R: bytes and CPU per second, one key per event or batched, plus the snapshot per K.

    CPU per event = its in-process encode + decode + apply, plus the transport's CPU per event (paced ZeroMQ CPU
    less the in-process part of a one-key event; 0 when --zmq-events 0)."""
    beat, one = _in_process(0, budget_s=budget_s), _in_process(1, budget_s=budget_s)
    pair = _zmq_pair(zmq_events) if zmq_events else None
    transport_us = max(pair["paced"]["cpu_us_per_event"] - cpu_us(one), 0.0) if pair else 0.0
    beats_per_s = 1 / HEARTBEAT_S
    beat_cost_us, beat_bytes = beats_per_s * (cpu_us(beat) + transport_us), beats_per_s * beat["bytes"]
    rows = []
    for r in churns:
        batch = max(1, round(r * BATCH_S))
        batched, flushes = _in_process(batch, budget_s=budget_s), min(r, 1 / BATCH_S)
        rows.append({
            "churn_per_s": r,
            "per_key": {"events_per_s": r + beats_per_s, "bytes_per_s": round(r * one["bytes"] + beat_bytes, 1),
                        "cpu_us_per_s": round(r * (cpu_us(one) + transport_us) + beat_cost_us, 1)},
            "batched": {"keys_per_event": batch, "events_per_s": flushes + beats_per_s,
                        "bytes_per_s": round(flushes * batched["bytes"] + beat_bytes, 1),
                        "cpu_us_per_s": round(flushes * (cpu_us(batched) + transport_us) + beat_cost_us, 1)},
        })
    return {"heartbeat_s": HEARTBEAT_S, "batch_s": BATCH_S,
            "per_event": {"heartbeat": _rounded(beat), "one_key": _rounded(one)},
            "zmq_tcp_loopback": pair, "transport_cpu_us_per_event": round(transport_us, 2),
            "rows": rows,
            "snapshot": [_snapshot(k, budget_s=budget_s) for k in key_counts],
            "staleness_s": {"per_key": round(pair["paced"]["wall_us_per_event"] / 1e6, 6) if pair else None,
                            "batched": BATCH_S, "lost_event_noticed_within": HEARTBEAT_S,
                            "note": "per key: one event's delivery (paced wall); a gap or restart shows at the next "
                                    "event or heartbeat and costs a snapshot"}}


def cpu_us(d: dict[str, float]) -> float:
    return d["encode_us"] + d["decode_apply_us"]


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in d.items()}
