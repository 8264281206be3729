"""The planner over a simulated day (python -m epd_bench.fleet_sim runs it): the real `Planner` (epd_planner) reads
metrics a queueing model of the fleet writes, every 5-minute window of a day-shaped load, and the fleet follows its
recommendation from the next window on; the same day on the fixed fleet, side by side.

The model, per window: requests arrive at rate r(h), peak at noon, a fifth of it at midnight; each brings
`images` images of which `miss` are encoded, `encode_s` each, spread evenly over the encoders (rendezvous with a
load bound keeps them within 1.25 of the mean); an encoder is an M/M/1 queue at utilisation u: a wait of
encode_s u / (1 - u), exponential, so TTFT is `base_s` plus the encode plus that wait (its p90 2.3 times the mean
wait), and past u = 0.98 the queue grows for the whole window. A decoder holds r T / D sequences (Little's law,
T = tokens x ITL); K/V use follows them; beyond --max-num-seqs they queue. The numbers are the model's, not a run's:
what they test is the planner's decisions, with its hysteresis, against the load the model gives it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from epd_planner.model import Bounds, Targets
from epd_planner.planner import Planner, PlannerConfig
from epd_planner.sample import Histogram, Sample, Scrape

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)  # the proxy's


@dataclass
class DayModel:
    encoders: int = 1000
    decoders: int = 100
    peak_rps: float = 17_500.0  # requests/s at noon: 1,000 encoders at 70 % there
    images: float = 2.0
    miss: float = 0.4  # share of images encoded (the rest hit a cache: the simulator's 1M-image hit rate is ~0.6)
    encode_s: float = 0.05
    base_s: float = 0.3  # TTFT without any encoder wait: prefill, gather, network
    tokens: int = 50
    itl_s: float = 0.02
    max_num_seqs: int = 256
    window_s: float = 300.0

    def rate(self, hour: float) -> float:
        return self.peak_rps * (0.2 + 0.8 * (1 - math.cos(2 * math.pi * hour / 24)) / 2)


def _cdf_exp(x: float, base: float, mean: float) -> float:
    if x < base:
        return 0.0
    return 1.0 if mean <= 0 else 1 - math.exp(-(x - base) / mean)


@dataclass
class _World:
    """Cumulative counters per endpoint, as the real /metrics would show them."""

    m: DayModel
    t: float = 0.0
    enc: dict[str, dict[str, float]] = field(default_factory=dict)
    dec: dict[str, dict[str, float]] = field(default_factory=dict)
    requests: float = 0.0
    ttft: list[float] = field(default_factory=lambda: [0.0] * len(BUCKETS))
    ttft_sum: float = 0.0
    itl: list[float] = field(default_factory=lambda: [0.0] * len(BUCKETS))
    itl_sum: float = 0.0
    serial: int = 0

    def resize(self, pool: dict[str, dict[str, float]], role: str, n: int) -> None:
        while len(pool) < n:
            self.serial += 1
            pool[f"http://{role}-{self.serial}"] = {}
        for url in list(pool)[n:]:  # the newest go first, as the launcher retires them
            del pool[url]

    def window(self, hour: float) -> dict[str, float]:
        """One window of the model at `hour`: counters advanced; returns what it was (utilisations, p90s)."""
        m, w = self.m, self.m.window_s
        rate = m.rate(hour)
        u = rate * m.images * m.miss * m.encode_s / max(1, len(self.enc))
        wait = m.encode_s * u / (1 - u) if u < 0.98 else m.encode_s * 49 + (u - 0.98) * w / 2
        held = rate * m.tokens * m.itl_s / max(1, len(self.dec))  # sequences per decoder
        queue = max(0.0, held - m.max_num_seqs) / max(rate / max(1, len(self.dec)), 1e-9)
        itl = m.itl_s * (1 + 0.5 * min(1.0, held / m.max_num_seqs))
        base = m.base_s + m.encode_s * m.images * m.miss + queue
        n = rate * w
        self.t += w
        self.requests += n
        for i, le in enumerate(BUCKETS):
            self.ttft[i] += n * _cdf_exp(le, base, wait)
            self.itl[i] += n * m.tokens * (1.0 if le >= itl else 0.0)
        self.ttft_sum += n * (base + wait)
        self.itl_sum += n * m.tokens * itl
        for c in self.enc.values():
            c["run"] = c.get("run", 0.0) + min(u, 1.0) * w
            c["items"] = c.get("items", 0.0) + min(u, 1.0) * w / m.encode_s
            c["wait_sum"] = c.get("wait_sum", 0.0) + wait * min(u, 1.0) * w / m.encode_s
        for c in self.dec.values():
            c["held"] = min(held, m.max_num_seqs)
            c["waiting"] = held
            c["tokens"] = c.get("tokens", 0.0) + rate * m.tokens * w / max(1, len(self.dec))
            c["queue_sum"] = c.get("queue_sum", 0.0) + queue * n / max(1, len(self.dec))
            c["queue_count"] = c.get("queue_count", 0.0) + n / max(1, len(self.dec))
        return {"rate": rate, "encoder_u": u, "ttft_p90": base + wait * math.log(10), "itl": itl,
                "decoder_u": held / m.max_num_seqs}

    def sample(self) -> Sample:
        hist = [(le, n) for le, n in zip(BUCKETS, self.ttft, strict=True)]
        itl = [(le, n) for le, n in zip(BUCKETS, self.itl, strict=True)]
        proxy = Scrape("http://proxy", "proxy", self.t, values={"epd_proxy_requests_total": self.requests},
                       histograms={"epd_proxy_time_to_first_token_seconds": Histogram(self.ttft_sum, hist[-1][1], hist),
                                   "epd_proxy_inter_token_latency_seconds": Histogram(self.itl_sum, itl[-1][1], itl)})
        workers = [Scrape(url, "encoder", self.t, values={"epd_encoder_run_seconds_total": c.get("run", 0.0),
                                                          "epd_encoder_items_encoded_total": c.get("items", 0.0)},
                          histograms={"epd_encoder_queue_wait_seconds": Histogram(c.get("wait_sum", 0.0),
                                                                                  c.get("items", 0.0))})
                   for url, c in self.enc.items()]
        blocks = 1000.0 * self.m.max_num_seqs
        workers += [Scrape(url, "decoder", self.t, values={
            "epd_decoder_waiting": c.get("waiting", 0.0), "max_num_seqs": float(self.m.max_num_seqs),
            "epd_decoder_kv_blocks_total": blocks, "epd_decoder_kv_blocks_free": blocks - 900.0 * c.get("held", 0.0),
            "epd_decoder_generated_tokens_total": c.get("tokens", 0.0)},
            histograms={"epd_decoder_request_queue_time_seconds": Histogram(c.get("queue_sum", 0.0),
                                                                            c.get("queue_count", 0.0))})
            for url, c in self.dec.items()]
        return Sample(self.t, self.t, [proxy], workers)


def day(m: DayModel, planned: bool, targets: Targets, bounds: Bounds, share: float = 1.0) -> dict[str, object]:
    """A day of 5-minute windows from `share` of the model's fleet; with `planned` the fleet takes the planner's
    count from the next window on."""
    world = _World(m)
    world.resize(world.enc, "encoder", round(m.encoders * share))
    world.resize(world.dec, "decoder", round(m.decoders * share))
    planner = Planner(PlannerConfig("http://proxy", None, m.window_s, targets=targets, bounds=bounds),
                      read=world.sample)
    planner.step()
    windows = int(24 * 3600 / m.window_s)
    counts, broken, enc_hours, dec_hours = [], 0, 0.0, 0.0
    for i in range(windows):
        seen = world.window(i * m.window_s / 3600)
        broken += seen["ttft_p90"] > targets.ttft_slo or seen["itl"] > targets.itl_slo
        enc_hours += len(world.enc) * m.window_s / 3600
        dec_hours += len(world.dec) * m.window_s / 3600
        counts.append((len(world.enc), len(world.dec)))
        step = planner.step()
        if planned and step is not None:
            world.resize(world.enc, "encoder", step.recommended["encoder"])
            world.resize(world.dec, "decoder", step.recommended["decoder"])
    return {"planned": planned, "start": (round(m.encoders * share), round(m.decoders * share)), "windows": windows, "slo_broken_windows": broken, "encoder_hours": enc_hours,
            "decoder_hours": dec_hours, "encoders_min_max": (min(c[0] for c in counts), max(c[0] for c in counts)),
            "decoders_min_max": (min(c[1] for c in counts), max(c[1] for c in counts)),
            "encoders_by_hour": [counts[int(h * 3600 / m.window_s)][0] for h in range(24)]}
