"""Prefix cache micro-benchmark: what it costs a decoder to tell the proxy which prefixes it holds, two ways.

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

import asyncio
import json
import socket
import statistics
import threading
import time
from typing import Any

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI

from epd_bench.micro import emit, median_s, parser
from epd_bench.prefix_events import cpu_us, events, make_keys


def health_body(keys: list[str]) -> dict[str, object]:
    """A decoder's /health (decoder_service/server.py) with the planned `prefix_cache` summary."""
    return {"status": "ok", "role": "decoder", "model": "llava-hf/llava-1.5-7b-hf",
            "model_identity": {"family": "llava", "fingerprint": "0123456789abcdef", "hidden_size": 4096},
            "aggregated": False, "waiting": 0, "running": 3, "pid": 4242,
            "loaded": {"modules": ["language_model", "lm_head", "multi_modal_projector"], "num_parameters": 6_760_000_000},
            "prefix_cache": {"enabled": True, "block_size": 16, "bytes": 512 << 20, "capacity_bytes": 1 << 30,
                             "blocks": 2048, "keys": keys}}  # only the keys vary with K


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
    parts = {"json_dumps_us": median_s(lambda: json.dumps(body, separators=(",", ":")).encode(), budget_s=budget_s),
             "msgspec_encode_us": median_s(lambda: msgspec.json.encode(body), budget_s=budget_s),
             "json_loads_us": median_s(lambda: json.loads(raw), budget_s=budget_s),
             "msgspec_decode_us": median_s(lambda: msgspec.json.decode(raw), budget_s=budget_s),
             "set_rebuild_us": median_s(lambda: set(keys), budget_s=budget_s)}
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
            f"{cpu_us(e['per_event']['one_key']) + e['transport_cpu_us_per_event']:.3g} us of CPU each, plus "
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
    e = events(key_counts, churns, zmq_events, budget_s=budget_s)
    return {"summary_S": s, "events_E": e, "conclusion": conclusion(s, e),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = parser("prefix_publish", __doc__)
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
    emit(out, args.json, lambda r: str(r["conclusion"]), indent=2)


if __name__ == "__main__":
    main()
