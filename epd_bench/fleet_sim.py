"""The fleet simulator: python -m epd_bench.fleet_sim

In one process, N encoders and P proxies (the real Scheduler with rendezvous placement and the real bounded hint
index of each proxy, epd_bench/fleet_model.py) under a synthetic load: Poisson arrivals, 1-4 images a request drawn
from a Zipf-popular catalogue, lognormal encode times. It reports

- the hit rate (items not encoded again) against an all-knowing placement: one proxy whose index is unbounded and
  exact (it knows every item every encoder holds) and whose load counts are the fleet's own;
- load imbalance: max / mean of the encoders' outstanding items, sampled while the fleet is loaded;
- items moved when 1 % of the encoders leave or join: of the items the fleet holds, those whose rendezvous home
  changes;
- a proxy's memory: the entries its index and scheduler keep (and their bytes), for catalogues of 10k and 1M items.

Decoders take no part in image placement; `--decoders` only sizes the prefix-routing check (conversations' homes
over the decoders when one leaves). Last, the planner over a day-shaped load against fixed fleets
(epd_bench/fleet_day.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from epd_bench.fleet_day import DayModel, day
from epd_bench.fleet_model import Fleet
from epd_planner.model import Bounds, Targets
from scheduler.rendezvous import Ring

IMAGES_PER_REQUEST = (1, 1, 1, 2, 2, 3, 4)  # drawn uniformly: 2 on average
MEAN_ENCODE_S = 0.02


@dataclass
class Workload:
    catalogue: int  # distinct images
    requests: int
    zipf: float = 0.9  # popularity exponent
    utilization: float = 0.8  # offered encode work / fleet capacity if nothing were cached
    seed: int = 0


def item_hash(i: int) -> str:
    """A distinct 64-bit hex hash per catalogue entry (multiplying by an odd constant mod 2**64 is a bijection)."""
    return f"{(i * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF:016x}"


def draw(w: Workload, num_encoders: int) -> tuple[np.ndarray, np.ndarray, list[list[int]], np.ndarray]:
    """Arrival times, per-request image counts, catalogue indices and encode times, all drawn up front."""
    rng = np.random.default_rng(w.seed)
    weights = 1.0 / np.arange(1, w.catalogue + 1) ** w.zipf
    cdf = np.cumsum(weights / weights.sum())
    counts = rng.choice(IMAGES_PER_REQUEST, size=w.requests)
    picks = np.minimum(np.searchsorted(cdf, rng.random(int(counts.sum()))), w.catalogue - 1)
    rng.shuffle(ids := np.arange(w.catalogue))  # popularity is not in catalogue order
    rate = w.utilization * num_encoders / (MEAN_ENCODE_S * float(np.mean(IMAGES_PER_REQUEST)))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=w.requests))
    service = MEAN_ENCODE_S * rng.lognormal(-0.125, 0.5, size=int(counts.sum()))  # mean MEAN_ENCODE_S
    splits = np.cumsum(counts)[:-1]
    return arrivals, counts, [list(ids[p]) for p in np.split(picks, splits)], service


def simulate(w: Workload, num_encoders: int, num_proxies: int, cache_items: int, index_capacity: int) -> dict:
    arrivals, counts, requests, service = draw(w, num_encoders)
    fleet = Fleet(num_encoders, num_proxies, cache_items, index_capacity, seed=w.seed)
    k = 0
    started = time.perf_counter()
    for at, ids in zip(arrivals, requests, strict=True):
        fleet.advance(float(at))
        fleet.request([item_hash(int(i)) for i in ids], [float(s) for s in service[k:k + len(ids)]])
        k += len(ids)
    fleet.advance(math.inf)
    c = fleet.counts
    proxy = fleet.proxies[0]
    return {"hit_rate": c.hits / c.items, "items": c.items, "encoded": c.encoded, "stale_hints": c.stale,
            "index_entries": proxy.hint.num_entries(), "index_capacity": index_capacity,
            "proxy_bytes": proxy_bytes(fleet), "held": sum(len(e.cache) for e in fleet.encoders.values()),
            "moved": moved(fleet), "wall_s": time.perf_counter() - started}


def loaded(num_encoders: int, num_proxies: int, requests: int, utilization: float) -> dict:
    """Load imbalance when the bound binds: every image new (nothing to hit), offered at `utilization` of the fleet.
    Two measures, after a warm-up fifth: the encode work each encoder got (items encoded: what decides whether one
    saturates), max / mean over the encoders; and their queues (outstanding items) sampled every 200 requests,
    max / mean, which at a mean of a few items is dominated by whole items (the bound is ceil(1.25 (m + 1) / n))."""
    w = Workload(catalogue=10 ** 12, requests=requests, zipf=0.0, utilization=utilization, seed=1)
    arrivals, _, _, service = draw_uniform(w, num_encoders)
    fleet = Fleet(num_encoders, num_proxies, cache_items=1, seed=1)
    ratios, means, start = [], [], None
    for n, at in enumerate(arrivals):
        fleet.advance(float(at))
        if n == requests // 5:
            start = [e.encoded + e.outstanding for e in fleet.encoders.values()]
        fleet.request([f"u{n:x}"], [float(service[n])])
        if start is not None and n % 200 == 0:
            loads = fleet.loads()
            mean = sum(loads) / len(loads)
            means.append(mean)
            ratios.append(max(loads) / mean if mean else 1.0)
    assert start is not None
    work = [e.encoded + e.outstanding - s for e, s in zip(fleet.encoders.values(), start, strict=True)]
    return {"utilization": utilization, "proxies": num_proxies, "work_per_encoder": sum(work) / len(work),
            "work_imbalance": max(work) / (sum(work) / len(work)), "mean_outstanding": float(np.mean(means)),
            "queue_imbalance_mean": float(np.mean(ratios)), "queue_imbalance_p99": float(np.percentile(ratios, 99))}


def draw_uniform(w: Workload, num_encoders: int) -> tuple[np.ndarray, None, None, np.ndarray]:
    """One image a request, each new: arrival times and encode times."""
    rng = np.random.default_rng(w.seed)
    rate = w.utilization * num_encoders / MEAN_ENCODE_S
    return (np.cumsum(rng.exponential(1.0 / rate, size=w.requests)), None, None,
            MEAN_ENCODE_S * rng.lognormal(-0.125, 0.5, size=w.requests))


def proxy_bytes(fleet: Fleet) -> int:
    """What one proxy's placement state weighs: its index's entries (per-producer LRU and the holders map, with their
    keys) and its scheduler's per-encoder maps and encodes in flight."""
    proxy = fleet.proxies[0]
    hint, sched = proxy.hint, proxy.scheduler
    size = sys.getsizeof(hint.where) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in hint.where.items())
    size += sum(sys.getsizeof(v.held) for v in hint.views.values())  # the keys are shared with `where`
    size += sys.getsizeof(sched.encoders) + sys.getsizeof(sched.outstanding) + sys.getsizeof(sched.in_flight)
    return size + 8 * len(sched.encoders)  # the ring's seeds


def moved(fleet: Fleet, share: float = 0.01) -> dict[str, float]:
    """Of the items the fleet holds, the share whose rendezvous home changes when `share` of the encoders leave,
    or as many join."""
    names = list(fleet.encoders)
    held = [h for e in fleet.encoders.values() for h in e.cache]
    change = max(1, round(share * len(names)))
    before, left = Ring(names), Ring(names[change:])
    joined = Ring([*names, *(f"new{i}" for i in range(change))])
    homes = {h: before.home(h) for h in held}
    return {"leave": sum(homes[h] != left.home(h) for h in held) / max(1, len(held)),
            "join": sum(homes[h] != joined.home(h) for h in held) / max(1, len(held)), "held": len(held)}


def decoder_moves(num_decoders: int, conversations: int = 20_000) -> float:
    """Conversations whose decoder (their first key's rendezvous home) changes when one decoder leaves."""
    names = [f"d{i}" for i in range(num_decoders)]
    before, after = Ring(names), Ring(names[1:])
    keys = [item_hash(i) for i in range(conversations)]
    return sum(before.home(k) != after.home(k) for k in keys) / conversations


def planner_day(encoders: int, decoders: int) -> list[dict]:
    """The planner over a day (epd_bench/fleet_day.py): fixed fleets sized for the peak and for the mean, and the
    planner starting from each."""
    model = DayModel(encoders=encoders, decoders=decoders, peak_rps=17.5 * encoders)
    bounds = Bounds(min_encoders=max(1, encoders // 100), max_encoders=2 * encoders,
                    min_decoders=max(1, decoders // 10), max_decoders=2 * decoders)
    runs = []
    for planned, share in ((False, 1.0), (False, 0.6), (True, 1.0), (True, 0.6)):
        run = day(model, planned, Targets(), bounds, share)
        runs.append(run)
        print(f"day from {run['start']} ({'planner' if planned else 'fixed'}): SLO broken in "
              f"{run['slo_broken_windows']} of {run['windows']} windows; {run['encoder_hours']:.0f} encoder-hours, "
              f"{run['decoder_hours']:.0f} decoder-hours; encoders {run['encoders_min_max']}, decoders "
              f"{run['decoders_min_max']}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_bench.fleet_sim", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--encoders", type=int, default=1000)
    p.add_argument("--decoders", type=int, default=100)
    p.add_argument("--proxies", type=int, default=10)
    p.add_argument("--catalogues", type=int, nargs="+", default=[10_000, 1_000_000])
    p.add_argument("--requests", type=int, default=200_000)
    p.add_argument("--cache-items", type=int, default=500, help="items each encoder's cache holds")
    p.add_argument("--index-capacity", type=int, default=65_536, help="the proxy's hint index (INDEX_CAPACITY)")
    p.add_argument("--utilization", type=float, default=0.8)
    p.add_argument("--loaded-requests", type=int, default=300_000, help="the imbalance run's requests (all new)")
    p.add_argument("--loaded-utilization", type=float, default=0.9)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    results: dict = {"config": vars(args), "runs": []}
    for catalogue in args.catalogues:
        w = Workload(catalogue, args.requests, utilization=args.utilization)
        real = simulate(w, args.encoders, args.proxies, args.cache_items, args.index_capacity)
        oracle = simulate(w, args.encoders, 1, args.cache_items, 10 ** 12)
        run = {"workload": asdict(w), "placement": real, "all_knowing": oracle,
               "hit_rate_gap": oracle["hit_rate"] - real["hit_rate"]}
        results["runs"].append(run)
        print(f"catalogue {catalogue:>9}: hit rate {real['hit_rate']:.4f} (all-knowing {oracle['hit_rate']:.4f}, "
              f"gap {run['hit_rate_gap']:+.4f}); moved leave {real['moved']['leave']:.4f} join {real['moved']['join']:.4f}; "
              f"proxy index {real['index_entries']} entries, {real['proxy_bytes'] / 1e6:.1f} MB (the fleet holds "
              f"{real['held']}); "
              f"{real['wall_s']:.0f} s", flush=True)
    for proxies in sorted({args.proxies, 1}, reverse=True):
        run = loaded(args.encoders, proxies, args.loaded_requests, args.loaded_utilization)
        results.setdefault("loaded", []).append(run)
        print(f"loaded ({proxies} prox{'ies' if proxies > 1 else 'y'}, all items new, utilization "
              f"{run['utilization']}): encode work max/mean {run['work_imbalance']:.3f} "
              f"({run['work_per_encoder']:.0f} items each); queues max/mean {run['queue_imbalance_mean']:.2f} "
              f"(p99 {run['queue_imbalance_p99']:.2f}) at {run['mean_outstanding']:.2f} outstanding on average",
              flush=True)
    results["day"] = planner_day(args.encoders, args.decoders)
    results["decoder_moves_one_leaves"] = decoder_moves(args.decoders)
    print(f"conversations moved when 1 of {args.decoders} decoders leaves: {results['decoder_moves_one_leaves']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
