"""EC connector micro-benchmark: ECConsumer.gather (socket and shared memory) vs raw pyzmq vs memcpy vs a
safetensors file round trip.

    python -m epd_bench.connector [--transport tcp|ipc] [--sizes 64K,1M,4.5M,64M] [--iters N] [--json]

The producer side (a real ECProducer, or a bare ROUTER for raw zmq) runs in child processes started with
`--serve connector|raw`; the client runs here, and the connector (socket), connector (shared memory) and raw
iterations alternate so noise hits all three.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import zmq

from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from epd_bench.micro import ROOT, check, interleaved, parser, status_kib, stop, summary
from epd_contracts.embeddings import ImageFeatures

DEFAULT_SIZES = "64K,1M,4.5M,64M"  # 4.5M = bf16 576x4096, one LLaVA-1.5 image
RSS_BYTES = 64 << 20
WARMUP_BYTES = 64 << 10
HIDDEN = 4096
ITER_BYTES = 2 << 30  # iterations per payload ~ ITER_BYTES / payload, clamped below (under a minute per run)
MIN_ITERS, MAX_ITERS = 30, 1500
BASIS = "throughput_gbps = payload bytes / p50 (median) round-trip time; GB = 1e9 bytes"
METHODS = {
    "connector": "ECConsumer(cache_bytes=0, shm=False).gather of one bf16 item from a real ECProducer in a child "
                 "process (the socket path, sending from the producer's shared-memory segment)",
    "connector_shm": "ECConsumer(cache_bytes=0, shm=True).gather of the same item: a handle on the socket, the "
                     "segment mapped copy-on-write (pages are read later by whoever uses the tensor, not here)",
    "raw_zmq": "DEALER request -> ROUTER child replies with the payload frame (send/recv_multipart copy=False)",
    "memcpy": "numpy.copyto between preallocated uint8 arrays (one thread)",
    "safetensors_file": "safetensors.torch.save_file + load_file of the tensor in a temp dir",
}
TARGETS = {"ratio_vs_raw_zmq_min": 0.9, "ratio_shm_vs_memcpy_min": 0.5, "ratio_applies_to_payloads_min_bytes": 1 << 20,
           "rss_ratio_max": 1.5}


def parse_size(text: str) -> int:
    """Parse '64K', '4.5M', '1G' or a plain byte count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def label(nbytes: int) -> str:
    """Human label of a byte count: 64KiB, 4.5MiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g}{unit}"
    return f"{nbytes}B"


def payload_tensor(nbytes: int) -> torch.Tensor:
    """A bf16 tensor of exactly `nbytes` bytes, (tokens, 4096) when it divides evenly."""
    numel = nbytes // 2
    shape = (numel // HIDDEN, HIDDEN) if numel % HIDDEN == 0 else (numel,)
    return torch.randn(shape, generator=torch.Generator().manual_seed(nbytes)).to(torch.bfloat16)


def item_hash(nbytes: int) -> str:
    """The mm_hash under which the producer child holds the payload of `nbytes`."""
    return f"bench-{nbytes}"


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat uint8 buffer over a contiguous CPU tensor."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def serve_connector(bind: str, sizes: list[int]) -> None:
    """Child: print the address of an ECProducer holding one tensor per size; serve until stdin closes."""
    # every size in shared memory, so connector_shm measures the mapping path even below SHM_MIN_BYTES
    producer = ECProducer(bind=bind, cache_bytes=sum(sizes) + (1 << 20), shm_min_bytes=0).start()
    for n in sizes:
        producer.save_caches(item_hash(n), ImageFeatures(payload_tensor(n)))
    print(producer.address, flush=True)
    try:
        sys.stdin.read()
    finally:
        producer.close()


def serve_raw(bind: str, sizes: list[int]) -> None:
    """Child: like serve_connector, but a bare ROUTER replies to a size with that payload frame (copy=False)."""
    payloads = {n: byte_view(payload_tensor(n)) for n in sizes}
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(bind)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    print(router.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        ident, req = router.recv_multipart(copy=False)
        router.send_multipart([ident, payloads[int(req.bytes)]], copy=False)


@contextmanager
def child(args: list[str], timeout: float = 60.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start `python -m epd_bench.connector ARGS`, yield it with its first stdout line, and always stop it (its
    stdin closed: the child's signal to end)."""
    proc = subprocess.Popen([sys.executable, "-m", "epd_bench.connector", *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        check(bool(select.select([proc.stdout], [], [], timeout)[0]), f"child {args} printed nothing in {timeout}s")
        line = proc.stdout.readline().strip()
        check(bool(line), f"child {args} exited with {proc.poll()}")
        yield proc, line
    finally:
        proc.stdin.close()
        stop(proc, grace=5)
        proc.stdout.close()


def rss_probe(address: str) -> None:
    """Child: gather the 64 MiB item once and print the peak-RSS increase it caused."""
    consumer = ECConsumer(cache_bytes=0, shm=False)  # the socket path: received without a copy
    small, big = item_hash(WARMUP_BYTES), item_hash(RSS_BYTES)
    consumer.gather([small], {small: address}, timeout=30)
    before = status_kib("VmHWM") * 1024
    out = consumer.gather([big], {big: address}, timeout=60)[big]
    after = status_kib("VmHWM") * 1024
    print(json.dumps({"before": before, "after": after, "nbytes": out.nbytes}), flush=True)
    consumer.close()


def machine_info(load_start: float) -> dict[str, Any]:
    """Versions, CPU count and load of this machine."""
    return {"cpu_count": os.cpu_count(), "loadavg_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
            "python": platform.python_version(), "torch": torch.__version__, "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(), "numpy": np.__version__, "safetensors": safetensors.__version__,
            "platform": platform.platform()}


def fstype(path: str) -> str:
    """Filesystem type of the mount holding `path`, from /proc/self/mounts."""
    best, kind = "", "unknown"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mnt, fs = line.split()[:3]
        if path.startswith(mnt) and len(mnt) > len(best):
            best, kind = mnt, fs
    return kind


def bench_size(nbytes: int, iters: int, conn_addr: str, raw_addr: str, tmp: str) -> dict[str, Any]:
    """All four methods for one payload size."""
    consumer, h = ECConsumer(cache_bytes=0, shm=False), item_hash(nbytes)
    mapper = ECConsumer(cache_bytes=0, shm=True)
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(raw_addr)
    request = str(nbytes).encode()

    def gather() -> None:
        check(consumer.gather([h], {h: conn_addr}, timeout=60)[h].nbytes == nbytes, "connector: wrong size")

    def gather_shm() -> None:
        check(mapper.gather([h], {h: conn_addr}, timeout=60)[h].nbytes == nbytes, "connector_shm: wrong size")

    def raw() -> None:
        dealer.send_multipart([request])
        check(len(dealer.recv_multipart(copy=False)[-1]) == nbytes, "raw_zmq: wrong size")

    try:
        times = interleaved({"connector": gather, "raw_zmq": raw, "connector_shm": gather_shm}, iters,
                            warmup=max(3, iters // 20))
        stats, shm_stats = consumer.stats(), mapper.stats()
    finally:
        consumer.close()
        mapper.close()
        dealer.close()
    check(stats["num_items"] == 0 and stats["remote_fetches"] == stats["gathers"], f"consumer cached: {stats}")
    check(stats["shm_items_received"] == 0, f"socket consumer mapped: {stats}")
    check(shm_stats["shm_items_received"] == shm_stats["gathers"] == shm_stats["remote_fetches"],
          f"shm consumer did not map every item: {shm_stats}")
    src = payload_tensor(nbytes)
    src_bytes = np.frombuffer(byte_view(src), dtype=np.uint8)
    dst = np.empty_like(src_bytes)

    def memcpy() -> None:
        np.copyto(dst, src_bytes)  # single-threaded memcpy; torch's threaded copy_ stalls on a busy 2-core box

    times.update(interleaved({"memcpy": memcpy}, iters, warmup=3))
    path = os.path.join(tmp, f"{nbytes}.safetensors")

    def file_round_trip() -> None:
        safetensors.torch.save_file({"embeds": src}, path)
        check(safetensors.torch.load_file(path)["embeds"].nbytes == nbytes, "safetensors: wrong size")

    times.update(interleaved({"safetensors_file": file_round_trip}, max(10, iters // 4), warmup=2))
    result: dict[str, Any] = {"bytes": nbytes, **{name: summary(ts, nbytes) for name, ts in times.items()}}
    result["connector"]["remote_fetches"] = stats["remote_fetches"]  # == gathers: none served from a local cache
    for name, (base, ours) in {"ratio_vs_raw_zmq": ("raw_zmq", "connector"), "ratio_shm_vs_memcpy": (
            "memcpy", "connector_shm"), "ratio_shm_vs_raw_zmq": ("raw_zmq", "connector_shm")}.items():
        result[name] = round(float(np.median(times[base]) / np.median(times[ours])), 3)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start both servers, benchmark every size, then probe the consumer's peak RSS."""
    start, sizes = time.perf_counter(), [parse_size(s) for s in args.sizes.split(",")]
    load_start = round(os.getloadavg()[0], 2)
    served = ",".join(str(n) for n in sorted({*sizes, WARMUP_BYTES, RSS_BYTES}))
    tmp = tempfile.mkdtemp(prefix="epd-bench-")
    ipc = args.transport == "ipc"
    binds = {k: f"ipc://{tmp}/{k}.sock" if ipc else "tcp://127.0.0.1:0" for k in ("connector", "raw")}
    payloads: dict[str, Any] = {}
    try:
        with child(["--serve", "connector", "--bind", binds["connector"], "--sizes", served]) as (_, conn_addr), \
                child(["--serve", "raw", "--bind", binds["raw"], "--sizes", served]) as (_, raw_addr):
            for n in sizes:
                iters = args.iters or max(MIN_ITERS, min(MAX_ITERS, ITER_BYTES // n))
                payloads[label(n)] = bench_size(n, iters, conn_addr, raw_addr, tmp)
            with child(["--rss-probe", conn_addr], timeout=120) as (_, line):
                rss = json.loads(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rss_increase = rss["after"] - rss["before"]
    rss_ratio = round(rss_increase / RSS_BYTES, 3)
    big = {k: v for k, v in payloads.items() if v["bytes"] >= TARGETS["ratio_applies_to_payloads_min_bytes"]}
    meets = {f"ratio_vs_raw_zmq[{k}]": v["ratio_vs_raw_zmq"] >= TARGETS["ratio_vs_raw_zmq_min"] for k, v in big.items()}
    meets.update({f"ratio_shm_vs_memcpy[{k}]": v["ratio_shm_vs_memcpy"] >= TARGETS["ratio_shm_vs_memcpy_min"]
                  for k, v in big.items()})
    meets["consumer_peak_rss_increase_ratio"] = rss_ratio <= TARGETS["rss_ratio_max"]
    return {
        "benchmark": "epd_bench.connector", "transport": args.transport, "throughput_basis": BASIS,
        "latency": "one gather (or request/reply) round trip of one item, client in this process, server in a child",
        "methods": METHODS,
        "machine": machine_info(load_start),
        "safetensors_dir": {"path": tempfile.gettempdir(), "fstype": fstype(tmp), "tmpfs": fstype(tmp) == "tmpfs",
                            "note": "read right after write, so load_file hits the page cache, not the disk"},
        "payloads": payloads,
        "consumer_peak_rss_increase_bytes": rss_increase, "consumer_peak_rss_increase_ratio": rss_ratio,
        "consumer_rss_detail": {**rss, "payload_bytes": RSS_BYTES},
        "targets": TARGETS, "meets_targets": meets, "all_targets_met": all(meets.values()),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def markdown(report: dict[str, Any]) -> str:
    """A readable table of a report."""
    lines = [f"transport={report['transport']}  ({report['throughput_basis']})", "",
             "| payload | method | p50 ms | p99 ms | GB/s | vs raw_zmq | vs memcpy |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, res in report["payloads"].items():
        ratios = {"connector": (res["ratio_vs_raw_zmq"], None),
                  "connector_shm": (res["ratio_shm_vs_raw_zmq"], res["ratio_shm_vs_memcpy"])}
        for method in ("connector", "connector_shm", "raw_zmq", "memcpy", "safetensors_file"):
            s = res[method]
            cells = [name, method, f"{s['p50_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['throughput_gbps']:.2f}",
                     *("" if r is None else f"{r:.3f}" for r in ratios.get(method, (None, None)))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", f"consumer peak RSS increase for 64MiB: {report['consumer_peak_rss_increase_bytes']} "
                      f"B (x{report['consumer_peak_rss_increase_ratio']})", f"meets targets: {report['meets_targets']}"])


def main(argv: list[str] | None = None) -> None:
    """CLI entry point (benchmark, or one of the child roles)."""
    p = parser("connector", __doc__, "print one JSON object instead of a table")
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated payload sizes, e.g. 64K,1M")
    p.add_argument("--iters", type=int, default=0, help="timed iterations per payload (default: scaled by size)")
    p.add_argument("--serve", choices=("connector", "raw"), help=argparse.SUPPRESS)
    p.add_argument("--bind", help=argparse.SUPPRESS)
    p.add_argument("--rss-probe", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        sizes = [int(s) for s in args.sizes.split(",")]
        (serve_connector if args.serve == "connector" else serve_raw)(args.bind, sizes)
    elif args.rss_probe:
        rss_probe(args.rss_probe)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that stop the children
        report = run(args)
        print(json.dumps(report, indent=2) if args.json else markdown(report))


if __name__ == "__main__":
    main()
