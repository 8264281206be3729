"""An encoder killed (kill -9) and started again: TTFT of repeated images right before and right after, with the disk
tier (`--ec-disk-dir`: the restarted encoder serves them from its files) and without it (it encodes them again).

    python -m epd_bench.encoder_restart [--model bench] [--images 16] [--rounds 2] [--json]

One stack on loopback (epd_bench/stacks.py processes): an encoder, a decoder and the proxy attached to both. The
decoder keeps nothing between requests (`--ec-cache-bytes 0 --prefix-cache-bytes 0`), so every repeat is gathered
from the encoder and prefilled again; the JSON shows it (each pass's encoder gets_served, decoder remote_fetches and
proxy items skipped). The encoder's port is held for it (reserve_port), so every incarnation answers at the same URL.
After a restart the proxy probes the new encoder and re-snapshots its cache index; a pass starts only once the
proxy's log says it synced with the new encoder's address (and how many items the snapshot listed).

First each image is sent once (encoded; written to disk by the writer thread, waited for). Then each round:
  1. before: each image once more, one request at a time (the running encoder's memory);
  2. kill -9, start with the same --ec-disk-dir: after_disk, the same requests (read from the files);
  3. kill -9, start without a disk tier: after_nodisk, the same requests (encoded again);
  4. if a round follows: kill -9, start with the disk tier, each image once untimed (back in memory).
TTFT is the time to the first streamed content chunk (epd_bench/backends.py). Disk MB/s are the encoder's gauges
(bytes / seconds: file encoding and digest checks included).
Before each restart with the disk tier the files are dropped from the page cache (fsync, then
POSIX_FADV_DONTNEED: `drop_cached`), so the restarted encoder reads them from the device as after a reboot.
Results go to runs/bench-encoder-restart/<time>/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from epd_bench.backends import RequestInput, openai_chat
from epd_bench.dataset import DatasetSpec, SampleRequest, noise_image
from epd_bench.loads import delta, scrape, wait_for
from epd_bench.report import ROOT
from epd_bench.stacks import HOST, ProcSpec, Running, SystemSpec
from epd_common.server import ENV_REUSE_PORT
from epd_launcher.group import free_port, reserve_port

TARGET = 1.5  # after_disk / before, at most
SERVED = "bench"  # --served-model-name
DECODER_FLAGS = ("--ec-cache-bytes", "0", "--prefix-cache-bytes", "0", "--max-num-seqs", "4")
START_TIMEOUT_S = 300.0
# what each pass reads back from /metrics: short name -> metric (its delta over the pass is recorded)
ENCODER = {"items_encoded": "epd_encoder_items_encoded_total",
           "items_already_cached": "epd_encoder_items_already_cached_total",
           "gets_served": "epd_ec_producer_gets_served", "disk_items": "epd_ec_disk_items",
           "disk_hits": "epd_ec_disk_hits", "disk_writes": "epd_ec_disk_writes",
           "disk_write_bytes": "epd_ec_disk_write_bytes", "disk_write_seconds": "epd_ec_disk_write_seconds",
           "disk_read_bytes": "epd_ec_disk_read_bytes", "disk_read_seconds": "epd_ec_disk_read_seconds"}
DECODER = {"remote_fetches": "epd_ec_consumer_remote_fetches", "consumer_cache_hits": "epd_ec_consumer_cache_hits",
           "prefix_tokens_saved": "epd_decoder_prefix_cache_tokens_saved_total"}
PROXY = {"items_skipped": "epd_proxy_items_skipped_cached_total", "items_scheduled": "epd_proxy_items_scheduled_total"}
PASSES = {"before": "before (encoder memory)", "after_disk": "after kill -9, disk tier",
          "after_nodisk": "after kill -9, no disk tier"}
# who served each pass's repeats: summary name -> (process, counter)
SERVED_BY = {"items_encoded": ("encoder", "items_encoded"), "items_already_cached": ("encoder", "items_already_cached"),
             "gets_served": ("encoder", "gets_served"), "disk_hits": ("encoder", "disk_hits"),
             "decoder_remote_fetches": ("decoder", "remote_fetches"), "decoder_cache_hits": ("decoder", "consumer_cache_hits"),
             "decoder_prefix_tokens_saved": ("decoder", "prefix_tokens_saved"),
             "proxy_items_skipped": ("proxy", "items_skipped"), "proxy_items_scheduled": ("proxy", "items_scheduled")}
SYNCED = re.compile(r"cache index synced with (\S+): epoch \S+ seq \d+, (\d+) item\(s\)")


def drop_cached(folder: Path) -> int:
    """Write the disk tier's files down and ask the kernel to drop their pages, so the next reads go to the device;
    the number of files."""
    files = list(folder.glob("*/*.emb"))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def rate_mb_s(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e6 if seconds > 0 else None


def samples(n: int, seed: int, size: int) -> list[SampleRequest]:
    """One request per distinct random PNG: a short question, 2 output tokens (only the first one is timed)."""
    spec = DatasetSpec(image_width=size, image_height=size, image_format="png", seed=seed)
    return [SampleRequest(prompt=f"what is in picture {i}", images=(noise_image(spec, i),), image_ids=(i,),
                          output_len=2) for i in range(n)]


async def _send(url: str, requests: list[SampleRequest]) -> list[float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=30.0)) as client:
        ttfts = []
        for s in requests:
            out = await openai_chat(client, RequestInput(url=url, model=SERVED, sample=s, ignore_eos=True))
            if not out.success:
                raise RuntimeError(f"request for image {s.image_ids} failed: {out.error}")
            ttfts.append(out.ttft)
    return ttfts


class Stack:
    """The decoder and proxy, started once, and the encoder, killed and started again on the port held for it."""

    def __init__(self, model: str, run_dir: Path, threads: int):
        self.model, self.log_dir, self.threads = model, run_dir / "logs", threads
        self.disk_dir = run_dir / "ec-disk"
        self.hold = reserve_port(HOST)
        self.encoder_url = f"http://{HOST}:{self.hold.getsockname()[1]}"
        self.encoder: Running | None = None
        self.workers: Running | None = None
        self.starts = 0

    def _workers_spec(self) -> SystemSpec:
        dec_port, proxy_port = free_port(), free_port()
        dec = ProcSpec("decoder", (sys.executable, "-m", "decoder_service.cli", "--model", self.model, "--host", HOST,
                                   "--port", str(dec_port), "--log-level", "warning", *DECODER_FLAGS),
                       None, self.threads, f"http://{HOST}:{dec_port}")
        proxy = ProcSpec("proxy", (sys.executable, "-m", "epd_launcher.cli", "--host", HOST, "--port", str(proxy_port),
                                   "--served-model-name", SERVED, "--log-level", "info", "--health-interval", "0.5",
                                   "--encode-servers-urls", self.encoder_url, "--decode-servers-urls", dec.url),
                         None, None, f"http://{HOST}:{proxy_port}")
        return SystemSpec("workers", (dec, proxy), SERVED, decoder_url=dec.url)

    @property
    def proxy_log(self) -> Path:
        return self.log_dir / "workers-proxy.log"

    def encoder_argv(self, disk: bool) -> tuple[str, ...]:
        flags = ("--ec-disk-dir", str(self.disk_dir), "--ec-disk-bytes", str(1 << 30)) if disk else ()
        return (sys.executable, "-m", "encoder_service.cli", "--model", self.model, "--host", HOST, "--port",
                self.encoder_url.rsplit(":", 1)[1], "--ec-bind", f"tcp://{HOST}:0", "--log-level", "warning", *flags)

    def _start_encoder(self, disk: bool) -> None:
        self.starts += 1
        spec = ProcSpec("encoder", self.encoder_argv(disk), None, self.threads, self.encoder_url,
                        env=((ENV_REUSE_PORT, "1"),))  # binds beside self.hold
        self.encoder = Running(SystemSpec(f"{self.starts}-{'disk' if disk else 'nodisk'}", (spec,), SERVED),
                               self.log_dir)
        self.encoder.wait_healthy(START_TIMEOUT_S)

    def start(self) -> None:
        """The encoder (with the disk tier) first: the proxy waits for its workers' /health at start."""
        self._start_encoder(disk=True)
        self.workers = Running(self._workers_spec(), self.log_dir)
        self.workers.wait_healthy(START_TIMEOUT_S)

    def restart_encoder(self, disk: bool) -> dict[str, Any]:
        """kill -9 the encoder, start it again, wait until the proxy's index synced with it; the time it took and the
        number of items the proxy's snapshot of it listed."""
        assert self.encoder is not None
        log_from = self.proxy_log.stat().st_size
        start = time.monotonic()
        self.encoder.procs[0].send_signal(signal.SIGKILL)
        self.encoder.procs[0].wait()
        dropped = drop_cached(self.disk_dir) if disk else 0
        self._start_encoder(disk)
        healthy_s = time.monotonic() - start
        address = httpx.get(f"{self.encoder_url}/health", timeout=10.0).json()["ec_address"]
        found: list[int] = []

        def synced() -> bool:
            text = self.proxy_log.read_bytes()[log_from:].decode(errors="replace")
            found[:] = [int(n) for a, n in SYNCED.findall(text) if a == address]
            return bool(found)

        wait_for(synced, 60.0, f"the proxy's cache index synced with {address}")
        return {"disk": disk, "healthy_s": healthy_s, "synced_s": time.monotonic() - start,
                "proxy_snapshot_items": found[-1], "files_dropped_from_page_cache": dropped}

    def timed_pass(self, requests: list[SampleRequest]) -> dict[str, Any]:
        """The requests one at a time through the proxy: TTFTs and what each process counted meanwhile."""
        assert self.workers is not None
        urls = {"encoder": (self.encoder_url, ENCODER), "decoder": (self.workers.spec.procs[0].url, DECODER),
                "proxy": (self.workers.spec.url, PROXY)}
        before = {k: scrape(u, names) for k, (u, names) in urls.items()}
        ttfts = asyncio.run(_send(self.workers.spec.url, requests))
        after = {k: scrape(u, names) for k, (u, names) in urls.items()}
        return {"ttft_ms": [t * 1000.0 for t in ttfts], "mean_ttft_ms": statistics.mean(ttfts) * 1000.0,
                **{k: delta(before[k], after[k]) for k in urls}}

    def wait_written(self, n: int) -> dict[str, float]:
        """Wait until the disk tier holds n files (its writer runs behind the stores); the encoder's counters then."""
        wait_for(lambda: scrape(self.encoder_url, ENCODER)["disk_items"] >= n, 60.0, f"{n} items written to disk")
        return scrape(self.encoder_url, ENCODER)

    def stop(self) -> None:
        for r in (self.workers, self.encoder):
            if r is not None:
                r.stop()
        self.hold.close()


def one_round(stack: Stack, requests: list[SampleRequest], last: bool) -> dict[str, Any]:
    n = len(requests)
    out: dict[str, Any] = {"written": stack.wait_written(n), "before": stack.timed_pass(requests)}
    out["restart_disk"] = stack.restart_encoder(disk=True)
    out["after_disk"] = stack.timed_pass(requests)
    out["restart_nodisk"] = stack.restart_encoder(disk=False)
    out["after_nodisk"] = stack.timed_pass(requests)
    if not last:
        stack.restart_encoder(disk=True)
        stack.timed_pass(requests)  # untimed: the files back in memory for the next round's `before`
    return out


def summarize(rounds: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Means over every round, ratios to `before`, disk rates, and per pass (one value a round) who served it."""
    mean = {p: statistics.mean(t for r in rounds for t in r[p]["ttft_ms"]) for p in PASSES}
    written, read = rounds[0]["written"], [r["after_disk"]["encoder"] for r in rounds]
    by = {p: {k: [r[p][proc][c] for r in rounds] for k, (proc, c) in SERVED_BY.items()} for p in PASSES}
    from_encoder = all(x["gets_served"] == x["decoder_remote_fetches"] == [n] * len(rounds)
                       and not any(x["decoder_cache_hits"] + x["decoder_prefix_tokens_saved"]) for x in by.values())
    return {"images": n, "mean_ttft_ms": mean, "after_disk_vs_before": mean["after_disk"] / mean["before"],
            "after_nodisk_vs_before": mean["after_nodisk"] / mean["before"], "target": TARGET,
            "met": mean["after_disk"] / mean["before"] <= TARGET,
            "disk_writes": written["disk_writes"],
            "disk_write_mb_s": rate_mb_s(written["disk_write_bytes"], written["disk_write_seconds"]),
            "disk_read_mb_s": rate_mb_s(sum(x["disk_read_bytes"] for x in read), sum(x["disk_read_seconds"] for x in read)),
            "items_encoded_after_restart": {"disk": [r["after_disk"]["encoder"]["items_encoded"] for r in rounds],
                                            "nodisk": [r["after_nodisk"]["encoder"]["items_encoded"] for r in rounds]},
            "served_by": by, "every_repeat_from_encoder": from_encoder,
            "restarts": {kind: [r[f"restart_{kind}"] for r in rounds] for kind in ("disk", "nodisk")}}


def run(model: str, images: int, rounds: int, out_dir: Path, image_size: int = 224, seed: int = 0,
        command: str = "") -> dict[str, Any]:
    """The whole benchmark; the summary (also written to out_dir/<time>/summary.json)."""
    started = time.monotonic()
    run_dir = out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
    requests = samples(images, seed, image_size)
    cores = len(os.sched_getaffinity(0))
    stack = Stack(model, run_dir, max(1, cores // 2))
    try:
        stack.start()
        warm = stack.timed_pass(requests)  # encodes every image once
        detail = [one_round(stack, requests, last=r == rounds - 1) for r in range(rounds)]
    finally:
        stack.stop()
    summary = {"command": command, "date": datetime.now().strftime("%Y-%m-%d %H:%M"), "model": model,
               "rounds": rounds, "image_size": image_size, "cores": cores, "threads_per_worker": max(1, cores // 2),
               "decoder_flags": list(DECODER_FLAGS), **summarize(detail, images), "first_pass": warm,
               "rounds_detail": detail, "run_dir": str(run_dir), "wall_s": round(time.monotonic() - started, 1)}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _one(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def report(s: dict[str, Any]) -> str:
    """The summary as a table: one row per pass, each counter as one value a round."""
    cols = ("items_encoded", "gets_served", "disk_hits", "decoder_remote_fetches", "proxy_items_skipped")
    rows = [f"  {'pass':27s} {'mean TTFT':>10s} {'vs before':>9s}  " + "  ".join(cols)]
    for p, title in PASSES.items():
        by = s["served_by"][p]
        rows.append(f"  {title:27s} {s['mean_ttft_ms'][p]:7.1f} ms {s['mean_ttft_ms'][p] / s['mean_ttft_ms']['before']:9.2f}  "
                    + "  ".join(f"{str([round(v) for v in by[c]]):>{len(c)}s}" for c in cols))
    restarts = {k: [(round(x["synced_s"], 1), x["proxy_snapshot_items"]) for x in v] for k, v in s["restarts"].items()}
    return "\n".join([
        f"encoder restart: model {s['model']}, {s['images']} images, {s['rounds']} round(s), {s['cores']} cores; "
        f"decoder {' '.join(s['decoder_flags'])}", *rows,
        f"  after restart with the disk tier / before: {s['after_disk_vs_before']:.2f} (target <= {s['target']}: "
        f"{'met' if s['met'] else 'missed'}); without it: {s['after_nodisk_vs_before']:.2f}",
        f"  disk: write {_one(s['disk_write_mb_s'])} MB/s ({s['disk_writes']:.0f} files), read {_one(s['disk_read_mb_s'])} MB/s",
        f"  every repeat gathered from the encoder (none from the decoder's caches): {s['every_repeat_from_encoder']}",
        f"  restart to the proxy synced (s, items in its snapshot): disk {restarts['disk']}, no disk {restarts['nodisk']}",
        f"results: {s['run_dir']}/summary.json; wall time {s['wall_s']} s"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_bench.encoder_restart", allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench", help="'bench' (built once, cached), 'demo' or a checkpoint dir")
    p.add_argument("--images", type=int, default=16, help="distinct images, each repeated once per pass")
    p.add_argument("--rounds", type=int, default=2, help="restarts with and without the disk tier")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-encoder-restart")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if args.images < 1 or args.rounds < 1:
        p.error("--images and --rounds must be >= 1")
    command = shlex.join([Path(sys.executable).name, "-m", "epd_bench.encoder_restart", *(argv or sys.argv[1:])])
    s = run(args.model, args.images, args.rounds, args.out_dir, args.image_size, command=command)
    print(json.dumps(s, indent=1) if args.json else report(s))


if __name__ == "__main__":
    main()
