"""Prefill and decode apart (E -> P -> D) against together (E + PD): the running streams' inter-token latency while
long prompts arrive, what the K/V hand-off adds to a long request, and the transfer's rate against raw ZeroMQ.

    python -m epd_bench.prefill_decode [--model bench-lm] [--rounds 4] [--handoff-min-tokens N] [--json]

Two loopback stacks (epd_bench/stacks.py), started together, measured in rounds of alternating order: e+pd (encoder,
decoder `--role both`, proxy) and e+p+d (encoder, prefill worker, decoder `--role decode`, proxy with
`--prefill-servers-urls`; short prompts are declined by --handoff-min-tokens and prefill on the decoder). The
decode-side decoder has the first half of the cores; prefill worker, encoder and proxy share the rest. A round:
`--streams` short streams decode without pause while `--long-prompts` long ones (new every time) arrive every
`--interval-s`. From the first long arrival to the last one's end: every gap between a short stream's content chunks
(p50, p99; E+P+D / E+PD, target <= 0.5; `running`: without each request's first gap), the short requests' TTFT and
chunks/s, each long request's TTFT and first-to-second gap (in e+p+d the hand-off sits there). After the stacks
stop, KVClient.fetch of the long prompts' K/V size against a raw ZeroMQ reply (epd_bench/kv_transfer.py). Results
go to runs/bench-prefill-decode/<time>/ (summary.json; samples.json: every gap).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from epd_bench.backends import RequestInput, openai_chat
from epd_bench.dataset import DatasetSpec, SampleRequest, noise_image, random_words
from epd_bench.kv_transfer import layout_of, transfer
from epd_bench.loads import Timed, delta, in_window, scrape
from epd_bench.report import ROOT
from epd_bench.stacks import HOST, ProcSpec, Running, SystemSpec, resolve_model, systems_summary
from epd_launcher.group import free_port

TARGET = 0.5  # the short streams' ITL p99, E+P+D / E+PD, at most
SERVED = "bench"
START_TIMEOUT_S = 600.0
# every decoder: a K/V pool that holds a few long prompts (the CPU default, a quarter of RAM, times four processes)
DECODER_FLAGS = ("--kv-cache-memory", "512MiB")
PROXY = {"handoffs": "epd_proxy_handoffs_total", "declined": "epd_proxy_handoffs_declined_total"}
DECODER = {"resumed_kv": 'epd_decoder_handoff_resumes_total{how="kv"}',
           "recomputed": 'epd_decoder_handoff_resumes_total{how="recomputed"}'}


@dataclass(frozen=True)
class Workload:
    streams: int = 4  # short streams decoding at once
    short_words: int = 8
    short_tokens: int = 64  # max_tokens of a short request
    long_prompts: int = 4  # per round
    long_words: int = 400  # about 1,450 tokens with the bench models' tokenizer
    long_images: int = 0
    long_tokens: int = 8  # max_tokens of a long request (its first gap is timed: at least 2)
    interval_s: float = 4.0  # between long arrivals
    lead_s: float = 1.0  # the short streams decode this long before the first long prompt arrives
    seed: int = 0
    handoff_min_tokens: int = -1  # e+p+d's decoders' --handoff-min-tokens (-1: their default, 512)

    def longs(self, round_: int) -> list[SampleRequest]:
        """Round `round_`'s long prompts (round -1: the warm-up's), the same for both stacks, new every round."""
        rng, spec = random.Random(f"long-{self.seed}-{round_}"), DatasetSpec(seed=self.seed, image_format="png")
        first = (round_ + 1) * self.long_prompts * self.long_images
        return [SampleRequest(prompt=f"{i} {random_words(rng, self.long_words)}",
                              images=tuple(noise_image(spec, first + i * self.long_images + k)
                                           for k in range(self.long_images)),
                              image_ids=(), output_len=self.long_tokens) for i in range(self.long_prompts)]

    def shorts(self, round_: int) -> Iterator[SampleRequest]:
        rng = random.Random(f"short-{self.seed}-{round_}")
        return (SampleRequest(random_words(rng, self.short_words), (), (), self.short_tokens) for _ in count())


def core_halves() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the decode side's cores, the prefill worker's, encoder's and proxy's); with one core both get it."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return tuple(cores[:half]), tuple(cores[half:]) or tuple(cores[:half])


def _worker(name: str, module: str, cpus: tuple[int, ...] | None, *flags: str) -> ProcSpec:
    port = free_port()
    argv = (sys.executable, "-m", module, "--host", HOST, "--port", str(port), "--log-level", "warning", "--insecure",
            *flags)
    return ProcSpec(name, argv, cpus, len(cpus) if cpus else None, f"http://{HOST}:{port}")


def build_systems(model_dir: Path, pin: bool, handoff_min_tokens: int = -1) -> list[SystemSpec]:
    """e+pd and e+p+d (in start order: encoder, decoders, proxy), pinned as the module docstring says."""
    decode_cpus, other_cpus = core_halves() if pin else (None, None)
    model, specs = ("--model", str(model_dir)), []
    for name, roles in (("e+pd", (("decoder", "both", decode_cpus),)),
                        ("e+p+d", (("prefill", "prefill", other_cpus), ("decoder", "decode", decode_cpus)))):
        enc = _worker("encoder", "encoder_service.cli", other_cpus, *model, "--ec-bind", f"tcp://{HOST}:0")
        decs = [_worker(n, "decoder_service.cli", cpus, *model, "--role", role, *DECODER_FLAGS,
                        *(("--handoff-min-tokens", str(handoff_min_tokens)) if handoff_min_tokens >= 0 else ()))
                for n, role, cpus in roles]
        prefill = ("--prefill-servers-urls", decs[0].url) if len(decs) > 1 else ()
        proxy = _worker("proxy", "epd_launcher.cli", other_cpus, "--served-model-name", SERVED, "--encode-servers-urls",
                        enc.url, "--decode-servers-urls", decs[-1].url, *prefill)
        specs.append(SystemSpec(name, (enc, *decs, proxy), SERVED, decoder_url=decs[-1].url))
    return specs


# the workload


async def _send(client: httpx.AsyncClient, url: str, sample: SampleRequest) -> Timed:
    return time.perf_counter(), await openai_chat(client, RequestInput(url, SERVED, sample, ignore_eos=True))


async def _round(url: str, w: Workload, round_: int) -> tuple[list[Timed], list[Timed]]:
    """(the short streams' requests, the long ones') of one round: the streams run until the last long one ends."""
    shorts, samples, stop, start = list[Timed](), w.shorts(round_), asyncio.Event(), time.perf_counter()
    limits = httpx.Limits(max_connections=w.streams + w.long_prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:

        async def stream() -> None:
            while not stop.is_set():
                shorts.append(await _send(client, url, next(samples)))

        async def arrive(i: int, sample: SampleRequest) -> Timed:
            await asyncio.sleep(max(0.0, start + w.lead_s + i * w.interval_s - time.perf_counter()))
            return await _send(client, url, sample)

        streams = [asyncio.create_task(stream()) for _ in range(w.streams)]
        longs = list(await asyncio.gather(*(arrive(i, s) for i, s in enumerate(w.longs(round_)))))
        stop.set()
        await asyncio.gather(*streams)
    return shorts, longs


def measure_round(run: Running, w: Workload, round_: int) -> dict[str, Any]:
    """One round on one stack: the short streams in the window, the long requests, what proxy and decoder counted."""
    urls = {"proxy": (run.spec.url, PROXY), "decoder": (str(run.spec.decoder_url), DECODER)}
    before = {k: scrape(u, names) for k, (u, names) in urls.items()}
    shorts, longs = asyncio.run(_round(run.spec.url, w, round_))
    after = {k: scrape(u, names) for k, (u, names) in urls.items()}
    failed = [o.error for _, o in shorts + longs if not o.success]
    ok = [o for _, o in longs if o.success]
    return {**in_window(shorts, longs), "short_requests": len(shorts), "long_requests": len(longs),
            "failed": len(failed), "errors": failed[:5], "long_ttft_s": [o.ttft for o in ok],
            "long_first_to_second_s": [o.itl[0] for o in ok if o.itl],
            "long_prompt_tokens": [o.prompt_tokens for o in ok], **{k: delta(before[k], after[k]) for k in urls}}


def warm_up(run: Running, w: Workload) -> dict[str, Any]:
    """A long request beside one short stream, unmeasured; in e+p+d it must have been handed off."""
    r = measure_round(run, replace(w, streams=1, long_prompts=1, lead_s=0.0), -1)
    if r["failed"] or (run.spec.name == "e+p+d" and not r["decoder"]["resumed_kv"]):
        raise RuntimeError(f"{run.spec.name} warm-up: {r['failed']} failed {r['errors']}; {r['proxy']} {r['decoder']}")
    return {k: r[k] for k in ("long_ttft_s", "long_prompt_tokens", "proxy", "decoder")}


# the run
def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000.0, 2) if values else None


def system_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One stack's rounds pooled: percentiles (ms) and medians, the counters summed."""
    pooled = {k: [x for r in rounds for x in r[k]] for k in ("itl_s", "itl_running_s", "short_ttft_s", "long_ttft_s",
                                                            "long_first_to_second_s", "long_prompt_tokens")}
    counters = {f"{proc}_{k}": sum(r[proc][k] for r in rounds) for proc in ("proxy", "decoder") for k in rounds[0][proc]}
    return {**{k.removesuffix("_s") + "_ms": {"p50": _ms(pooled[k], 50), "p99": _ms(pooled[k], 99), "n": len(pooled[k])}
               for k in ("itl_s", "itl_running_s", "short_ttft_s")},
            "itl_p99_ms_by_round": [_ms(r["itl_s"], 99) for r in rounds],
            "short_chunks_per_s": round(statistics.fmean(r["short_chunks_per_s"] for r in rounds), 1),
            "long_ttft_ms": _ms(pooled["long_ttft_s"], 50),
            "long_first_to_second_ms": _ms(pooled["long_first_to_second_s"], 50),
            "long_prompt_tokens": round(statistics.median(pooled["long_prompt_tokens"] or [0])),
            "requests": sum(r["short_requests"] + r["long_requests"] for r in rounds),
            "failed": sum(r["failed"] for r in rounds), "errors": [e for r in rounds for e in r["errors"]][:5],
            **counters}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(systems: dict[str, Any]) -> dict[str, Any]:
    """E+P+D against E+PD: the ratios, and what the hand-off adds to a long request's second token (ms)."""
    apart, together = systems["e+p+d"], systems["e+pd"]
    ratios = {f"{k}_{q}_ratio": _ratio(apart[f"{k}_ms"][q], together[f"{k}_ms"][q])
              for k in ("itl", "itl_running") for q in ("p50", "p99")}
    added = [apart["long_first_to_second_ms"], together["long_first_to_second_ms"]]
    return {**ratios, "target": TARGET, "met": ratios["itl_p99_ratio"] is not None and ratios["itl_p99_ratio"] <= TARGET,
            "long_ttft_ratio": _ratio(apart["long_ttft_ms"], together["long_ttft_ms"]),
            "transfer_added_ms": None if None in added else round(added[0] - added[1], 2)}


def run(model: str, w: Workload, rounds: int, out_dir: Path, pin: bool = True, command: str = "") -> dict[str, Any]:
    """The whole benchmark; the summary (also written to out_dir/<time>/summary.json)."""
    started, load_before = time.monotonic(), os.getloadavg()
    run_dir = out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
    model_dir, pin = resolve_model(model), pin and shutil.which("taskset") is not None
    specs, running = build_systems(model_dir, pin, w.handoff_min_tokens), []
    running += [Running(spec, run_dir / "logs") for spec in specs]
    detail: dict[str, list[dict[str, Any]]] = {s.name: [] for s in specs}
    try:
        for r in running:
            r.wait_healthy(START_TIMEOUT_S)
        health = httpx.get(f"{running[1].spec.decoder_url}/health", timeout=30.0).json()
        warm = {r.spec.name: warm_up(r, w) for r in running}
        for rnd in range(rounds):
            for r in running if rnd % 2 == 0 else running[::-1]:
                print(f"[{time.strftime('%H:%M:%S')}] round {rnd} on {r.spec.name}", file=sys.stderr, flush=True)
                detail[r.spec.name].append(measure_round(r, w, rnd))
    finally:
        for r in running:
            r.stop()
    systems = {name: system_summary(rs) for name, rs in detail.items()}
    tokens = max(s["long_prompt_tokens"] for s in systems.values())
    print(f"[{time.strftime('%H:%M:%S')}] K/V transfer of {tokens} positions", file=sys.stderr, flush=True)
    decode_cpus, other_cpus = core_halves() if pin else (None, None)
    out = {"command": command, "date": datetime.now().strftime("%Y-%m-%d %H:%M"), "model": model,
           "model_dir": str(model_dir), "cores": len(os.sched_getaffinity(0)), "load_before": load_before,
           "rounds": rounds, "workload": asdict(w), "decoder_flags": list(DECODER_FLAGS),
           "pinning": {"pinned": pin, "decode_side": decode_cpus, "prefill_encoder_proxy": other_cpus,
                       "client": "not pinned", "transfer": "not pinned, after the stacks stopped"},
           "bytes_per_token": health["kv_cache"]["bytes_per_token"], "systems": systems, **compare(systems),
           "transfer": transfer(layout_of(model_dir, health), tokens), "warm_up": warm,
           "processes": systems_summary(specs, {}), "load_after": os.getloadavg()}
    out.update(run_dir=str(run_dir), wall_s=round(time.monotonic() - started, 1))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1))
    (run_dir / "samples.json").write_text(json.dumps(detail))
    return out


# report column -> where its value is in a system's summary
COLUMNS = {"ITL p50": "itl_ms.p50", "p99": "itl_ms.p99", "running p99": "itl_running_ms.p99",
           "short TTFT p50": "short_ttft_ms.p50", "chunks/s": "short_chunks_per_s", "long TTFT": "long_ttft_ms",
           "1st->2nd": "long_first_to_second_ms", "hand-offs": "proxy_handoffs", "declined": "proxy_declined", "kv": "decoder_resumed_kv",
           "recomputed": "decoder_recomputed", "failed": "failed"}


def _cell(x: Any, path: str, width: int) -> str:
    for key in path.split("."):
        x = x[key]
    return f"{'n/a' if x is None else f'{x:.1f}':>{width}s}"


def report(s: dict[str, Any]) -> str:
    w, p, kv = s["workload"], s["pinning"], s["transfer"]
    rows = [f"  {'':6s}" + "".join(f" {h:>8s}" for h in COLUMNS)]
    rows += [f"  {name:6s}" + "".join(f" {_cell(x, path, max(8, len(h)))}" for h, path in COLUMNS.items())
             for name, x in s["systems"].items()]
    return "\n".join([
        f"prefill and decode apart: model {s['model']}, {s['rounds']} round(s): {w['streams']} short streams of "
        f"{w['short_tokens']} tokens while {w['long_prompts']} long prompts a round (about "
        f"{s['systems']['e+p+d']['long_prompt_tokens']} tokens, {w['long_images']} images) arrive every "
        f"{w['interval_s']} s",
        f"  pinned: {p['pinned']}; decode side cores {p['decode_side']}; prefill worker, encoder and proxy cores "
        f"{p['prefill_encoder_proxy']}; client {p['client']}. Times in ms:", *rows,
        f"  short streams' ITL p99, E+P+D / E+PD: {s['itl_p99_ratio']} (target <= {s['target']}: "
        f"{'met' if s['met'] else 'missed'}); running (no first gaps) p99 {s['itl_running_p99_ratio']}; p50 "
        f"{s['itl_p50_ratio']}; long TTFT {s['long_ttft_ratio']}",
        f"  the hand-off adds {s['transfer_added_ms']} ms to a long request's second token (median first-to-second "
        f"gap, E+P+D - E+PD)",
        f"  K/V of {kv['num_tokens']} positions ({kv['bytes'] / 2**20:.2f} MiB, {kv['blocks']} blocks): "
        f"KVClient.fetch {kv['kv_fetch_mb_s']} MB/s (p50 {kv['kv_fetch']['p50_ms']} ms), raw ZeroMQ "
        f"{kv['raw_zmq_mb_s']} MB/s (p50 {kv['raw_zmq']['p50_ms']} ms): ratio {kv['ratio']}",
        f"results: {s['run_dir']}/summary.json; wall time {s['wall_s']} s"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_bench.prefill_decode", allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-lm", help="'bench-lm' (built once, cached), 'demo' or a checkpoint dir")
    p.add_argument("--rounds", type=int, default=4, help="rounds per stack, alternating their order")
    for f in fields(Workload):  # the workload's fields, as described above
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=f.default)
    p.add_argument("--pinning", choices=("split", "none"), default="split", help="split: as described above")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench-prefill-decode")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if min(args.rounds, args.streams, args.long_prompts, args.short_tokens) < 1 or args.long_tokens < 2:
        p.error("--rounds, --streams, --long-prompts and --short-tokens must be >= 1, --long-tokens >= 2")
    w = Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})
    command = shlex.join([Path(sys.executable).name, "-m", "epd_bench.prefill_decode", *(argv or sys.argv[1:])])
    s = run(args.model, w, args.rounds, args.out_dir, args.pinning == "split", command)
    print(json.dumps(s, indent=1) if args.json else report(s))


if __name__ == "__main__":
    main()
