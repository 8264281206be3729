"""Prefix cache micro-benchmark (issue 16): how a decoder tells the proxy which prefixes it holds.

    python -m epd_bench.prefix_publish [--json] [--keys 256 1024 4096] [--churn 10 100] [--interval 2.0]

A decoder holds K prefix keys (32 hex characters each), R of which are stored or evicted per second.

- Option S, summary: every health probe (the proxy's --health-interval, 2 s by default) GETs /health, whose
  `prefix_cache.keys` lists all K keys; the proxy rebuilds its set of them. Timed in process through the real
  stack (a FastAPI route annotated like the decoder's, httpx over ASGITransport, `resp.json()`, `set(...)`), and
  broken down into encode (the route's serialization; json.dumps and msgspec for comparison), decode
  (json.loads as httpx does; msgspec) and set rebuild. Marginal = with K keys minus with none.
- Option E, events: the decoder publishes `stored`/`evicted` events the way encoders publish cache events
  (connector/tensors/server.py: one msgspec-encoded CacheEvent per key, each with the next seq, plus a heartbeat
  every HEARTBEAT_S) over ZeroMQ PUB/SUB, and the proxy applies them to a ProducerView
  (connector/control/cache_index.py). Timed per event in process (encode_message, decode_message, apply_event),
  then through a real PUB/SUB pair on loopback TCP (wall and process CPU, ZeroMQ's I/O threads included). Also a
  batched variant (one event per 100 ms carrying every key that changed), and the snapshot a subscriber needs at
  start, after a gap, or when the decoder restarts.

Staleness: S sees a change on the next probe (up to one interval later, half on average); E within the event's
delivery (well under a millisecond on loopback), and a lost event shows at the next event or heartbeat.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec
import uvicorn
import zmq
from fastapi import FastAPI

from connector.control.cache_index import ProducerView
from connector.control.wire import MAX_REPLY_HEADER_BYTES, decode_message, encode_message
from epd_contracts.ec import HEARTBEAT_S, CacheEvent, SnapshotReply

ZMTP_FRAME_OVERHEAD = 2  # bytes a ZMTP 3 short frame (< 256 bytes) adds: flags and size
BATCH_S = 0.1  # the batched variant's flush interval
PRODUCER = "tcp://10.0.0.7:5601"  # a typical advertised address (it is part of every event)
EPOCH = "9f3c1e2a7b6d4c5e"  # a producer epoch (secrets.token_hex(8), as connector/tensors/producer.py)


def make_keys(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def health_body(keys: list[str]) -> dict[str, object]:
    """A decoder's /health (decoder_service/server.py) with the planned `prefix_cache` summary."""
    return {"status": "ok", "role": "decoder", "model": "llava-hf/llava-1.5-7b-hf",
            "model_identity": {"family": "llava", "fingerprint": "0123456789abcdef", "hidden_size": 4096},
            "aggregated": False, "waiting": 0, "running": 3, "pid": 4242,
            "loaded": {"modules": ["language_model", "lm_head", "multi_modal_projector"], "num_parameters": 6_760_000_000},
            "prefix_cache": {"enabled": True, "block_size": 16, "bytes": 512 << 20, "capacity_bytes": 1 << 30,
                             "blocks": 2048, "keys": keys}}  # only the keys vary with K


def median_s(fn: Callable[[], object], budget_s: float = 0.2, min_reps: int = 5, max_reps: int = 2000) -> float:
    """Median seconds of fn() after one warm-up call: at least min_reps runs, more while within budget_s."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (spent < budget_s and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)


class _Decoder:
    """A decoder's /health on a real uvicorn server on loopback, in a thread; GET /health?keys=K lists K keys."""

    def __init__(self, key_counts: list[int]) -> None:
        self.keys = {k: make_keys(k) for k in {0, *key_counts}}
        app = FastAPI()

        @app.get("/health")
        async def health(keys: int = 0) -> dict[str, object]:  # annotated like the decoder's, so serialized alike
            return health_body(list(self.keys[keys]))  # the decoder lists its held keys per probe

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> _Decoder:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:  # readiness, polled
            assert self.thread.is_alive() and time.monotonic() < deadline, "health server did not start"
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


Probe = dict[str, float]  # median wall_s, cpu_s, and bytes of one probe


async def _probes(url: str, key_counts: list[int], budget_s: float) -> dict[int, tuple[Probe, Probe]]:
    """Per K: (a probe listing K keys, a probe listing none) as the proxy makes them: httpx GET, resp.json(), a set
    of the keys. The two alternate, so drift on this shared machine hits both alike."""
    out: dict[int, tuple[Probe, Probe]] = {}
    async with httpx.AsyncClient(base_url=url) as client:
        async def probe(k: int) -> tuple[float, float, int]:
            wall, cpu = time.perf_counter(), time.process_time()  # the server thread's CPU is this process's too
            resp = await client.get("/health", params={"keys": k})
            keys = set(resp.json()["prefix_cache"]["keys"])
            assert resp.status_code == 200 and len(keys) == k
            return time.perf_counter() - wall, time.process_time() - cpu, len(resp.content)

        def stats(runs: list[tuple[float, float, int]]) -> Probe:
            # CPU as a mean: a probe takes a few ms of CPU, in steps of the scheduler's accounting, so a median of
            # few samples jumps; wall as a median (it mostly waits on loopback TCP acks)
            return {"wall_s": statistics.median(r[0] for r in runs), "cpu_s": statistics.fmean(r[1] for r in runs),
                    "bytes": runs[0][2]}

        for k in key_counts:
            await probe(0), await probe(k)  # warm-up
            with_keys: list[tuple[float, float, int]] = []
            without: list[tuple[float, float, int]] = []
            start = time.perf_counter()
            while len(with_keys) < 5 or (time.perf_counter() - start < budget_s and len(with_keys) < 500):
                without.append(await probe(0))
                with_keys.append(await probe(k))
            out[k] = (stats(with_keys), stats(without))
    return out


def _summary_row(k: int, interval: float, budget_s: float, probes: tuple[Probe, Probe]) -> dict[str, Any]:
    keys = make_keys(k)
    body = health_body(keys)
    raw = json.dumps(body, separators=(",", ":")).encode()
    parts = {"json_dumps_us": median_s(lambda: json.dumps(body, separators=(",", ":")).encode(), budget_s),
             "msgspec_encode_us": median_s(lambda: msgspec.json.encode(body), budget_s),
             "json_loads_us": median_s(lambda: json.loads(raw), budget_s),
             "msgspec_decode_us": median_s(lambda: msgspec.json.decode(raw), budget_s),
             "set_rebuild_us": median_s(lambda: set(keys), budget_s)}
    with_keys, without = probes
    marginal_cpu = max(with_keys["cpu_s"] - without["cpu_s"], 0.0)
    key_bytes = with_keys["bytes"] - without["bytes"]
    return {"keys": k, "bytes_per_probe": int(with_keys["bytes"]), "key_bytes_per_probe": int(key_bytes),
            "probe_wall_us": round(with_keys["wall_s"] * 1e6, 1), "probe_cpu_us": round(with_keys["cpu_s"] * 1e6, 1),
            "probe_without_keys_cpu_us": round(without["cpu_s"] * 1e6, 1),
            "marginal_wall_us": round(max(with_keys["wall_s"] - without["wall_s"], 0.0) * 1e6, 1),
            "marginal_cpu_us": round(marginal_cpu * 1e6, 1),
            **{name: round(v * 1e6, 1) for name, v in parts.items()},
            "bytes_per_s": round(key_bytes / interval, 1), "cpu_us_per_s": round(marginal_cpu * 1e6 / interval, 1)}


def summary(key_counts: list[int], interval: float, budget_s: float, probe_budget_s: float) -> dict[str, Any]:
    """Option S per K: bytes and CPU per probe (whole, marginal over a probe without keys, and split up), and per
    second at one probe per interval (per decoder, per proxy). CPU: both ends, as one process's."""
    with _Decoder(key_counts) as decoder:
        probes = asyncio.run(_probes(decoder.url, key_counts, probe_budget_s))
    return {"interval_s": interval, "transport": "uvicorn + httpx on loopback TCP, in one process",
            "rows": [_summary_row(k, interval, budget_s, probes[k]) for k in key_counts],
            "staleness_s": {"mean": interval / 2, "max": interval,
                            "note": "a change shows at the next probe (plus its round trip)"}}


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

    return {"encode_us": median_s(lambda: encode_message(_event(seq, kind, keys)), budget_s) * 1e6,
            "decode_apply_us": median_s(decode_apply, budget_s) * 1e6, "bytes": float(_frame_bytes(raw))}


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
                                        budget_s) * 1e6, 1),
            "decode_apply_us": round(median_s(decode_apply, budget_s) * 1e6, 1)}


def events(key_counts: list[int], churns: list[float], zmq_events: int, budget_s: float) -> dict[str, Any]:
    """Option E per churn R: bytes and CPU per second, one key per event or batched, plus the snapshot per K.

    CPU per event = its in-process encode + decode + apply, plus the transport's CPU per event (paced ZeroMQ CPU
    less the in-process part of a one-key event; 0 when --zmq-events 0)."""
    beat, one = _in_process(0, budget_s), _in_process(1, budget_s)
    pair = _zmq_pair(zmq_events) if zmq_events else None
    transport_us = max(pair["paced"]["cpu_us_per_event"] - _cpu_us(one), 0.0) if pair else 0.0
    beats_per_s = 1 / HEARTBEAT_S
    beat_cost_us, beat_bytes = beats_per_s * (_cpu_us(beat) + transport_us), beats_per_s * beat["bytes"]
    rows = []
    for r in churns:
        batch = max(1, round(r * BATCH_S))
        batched, flushes = _in_process(batch, budget_s), min(r, 1 / BATCH_S)
        rows.append({
            "churn_per_s": r,
            "per_key": {"events_per_s": r + beats_per_s, "bytes_per_s": round(r * one["bytes"] + beat_bytes, 1),
                        "cpu_us_per_s": round(r * (_cpu_us(one) + transport_us) + beat_cost_us, 1)},
            "batched": {"keys_per_event": batch, "events_per_s": flushes + beats_per_s,
                        "bytes_per_s": round(flushes * batched["bytes"] + beat_bytes, 1),
                        "cpu_us_per_s": round(flushes * (_cpu_us(batched) + transport_us) + beat_cost_us, 1)},
        })
    return {"heartbeat_s": HEARTBEAT_S, "batch_s": BATCH_S,
            "per_event": {"heartbeat": _rounded(beat), "one_key": _rounded(one)},
            "zmq_tcp_loopback": pair, "transport_cpu_us_per_event": round(transport_us, 2),
            "rows": rows,
            "snapshot": [_snapshot(k, budget_s) for k in key_counts],
            "staleness_s": {"per_key": round(pair["paced"]["wall_us_per_event"] / 1e6, 6) if pair else None,
                            "batched": BATCH_S, "lost_event_noticed_within": HEARTBEAT_S,
                            "note": "per key: one event's delivery (paced wall); a gap or restart shows at the next "
                                    "event or heartbeat and costs a snapshot"}}


def _cpu_us(d: dict[str, float]) -> float:
    return d["encode_us"] + d["decode_apply_us"]


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in d.items()}


def conclusion(s: dict[str, Any], e: dict[str, Any]) -> str:
    """Which option is cheaper at each K and R (CPU, bytes), and the staleness of each."""
    cases = []
    for srow in s["rows"]:
        for erow in e["rows"]:
            per_key, batched = erow["per_key"], erow["batched"]
            e_cpu = min(per_key["cpu_us_per_s"], batched["cpu_us_per_s"])
            e_net = min(per_key["bytes_per_s"], batched["bytes_per_s"])
            cpu = "E" if e_cpu < srow["cpu_us_per_s"] else "S"
            net = "E" if e_net < srow["bytes_per_s"] else "S"
            cases.append(f"K={srow['keys']} R={erow['churn_per_s']:g}/s: S {srow['cpu_us_per_s']:.3g} us/s CPU, "
                         f"{srow['bytes_per_s'] / 1e3:.3g} kB/s; E {per_key['cpu_us_per_s']:.3g} us/s, "
                         f"{per_key['bytes_per_s'] / 1e3:.3g} kB/s (batched {batched['cpu_us_per_s']:.3g} us/s, "
                         f"{batched['bytes_per_s'] / 1e3:.3g} kB/s): cheaper in CPU {cpu}, in bytes {net}")
    top = s["rows"][-1]
    stale = e["staleness_s"]["per_key"]
    return (f"Both are small: the most expensive case here is under {_max_cpu(s, e) / 1e4:.2g}% of one core. "
            f"S costs in proportion to K (at K={top['keys']}: {top['key_bytes_per_probe'] / 1e3:.3g} kB and "
            f"{top['marginal_cpu_us']:.3g} us of CPU per probe, both ends, every {s['interval_s']:g} s, whether or "
            f"not anything changed) and is up to {s['interval_s']:g} s stale ({s['interval_s'] / 2:g} s on "
            f"average); E costs in proportion to R (one ZeroMQ event per stored/evicted key, "
            f"{e['per_event']['one_key']['bytes']:.0f} B and about "
            f"{_cpu_us(e['per_event']['one_key']) + e['transport_cpu_us_per_event']:.3g} us of CPU each, plus "
            f"heartbeats) and is stale only by delivery ({stale if stale is not None else 'not measured'} s), but "
            f"needs a PUB socket and a snapshot endpoint on the decoder and a subscriber per proxy, and a snapshot "
            f"(K keys) at every start, gap or restart. S's encode is mostly the route's JSON: msgspec would cut "
            f"it {top['json_dumps_us'] / max(top['msgspec_encode_us'], 1e-3):.2g}x. Per case (E's better of per-key "
            f"and batched events compared): " + "; ".join(cases) + ".")


def _max_cpu(s: dict[str, Any], e: dict[str, Any]) -> float:
    return max([r["cpu_us_per_s"] for r in s["rows"]] + [r["per_key"]["cpu_us_per_s"] for r in e["rows"]])


def run(key_counts: list[int], churns: list[float], interval: float, zmq_events: int, budget_s: float = 0.2,
        probe_budget_s: float = 1.0) -> dict[str, Any]:
    start = time.perf_counter()
    s = summary(key_counts, interval, budget_s, probe_budget_s)
    e = events(key_counts, churns, zmq_events, budget_s)
    return {"summary_S": s, "events_E": e, "conclusion": conclusion(s, e),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser("epd_bench.prefix_publish", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--keys", nargs="+", type=int, default=[256, 1024, 4096], help="keys a decoder holds (K)")
    ap.add_argument("--churn", nargs="+", type=float, default=[10.0, 100.0], help="keys stored + evicted per s (R)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between health probes (proxy default)")
    ap.add_argument("--zmq-events", type=int, default=2000, help="events through the real PUB/SUB pair (0: skip)")
    ap.add_argument("--budget", type=float, default=0.2, help="seconds of repeats per in-process timing")
    ap.add_argument("--probe-budget", type=float, default=1.0, help="seconds of health probes per K")
    args = ap.parse_args(argv)
    if (min(args.keys) < 0 or min(args.churn) <= 0 or args.interval <= 0 or args.zmq_events < 0 or args.budget < 0
            or args.probe_budget < 0):
        ap.error("--keys >= 0, --churn > 0, --interval > 0, --zmq-events, --budget and --probe-budget >= 0")
    out = run(args.keys, args.churn, args.interval, args.zmq_events, args.budget, args.probe_budget)
    print(json.dumps(out, indent=2) if args.json else out["conclusion"])


if __name__ == "__main__":
    main()
