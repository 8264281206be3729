"""What happened between two samples: counter and histogram deltas per endpoint, and a quantile from bucket deltas
(Prometheus' histogram_quantile). Pure; a counter that went backwards (the process restarted) is BadValue."""
from __future__ import annotations

import math
from dataclasses import dataclass

from epd_planner.sample import BadValue, Histogram, Scrape


@dataclass(frozen=True)
class Span:
    """One endpoint over a window: its read at the start and at the end (both readable)."""

    start: Scrape
    end: Scrape

    @property
    def seconds(self) -> float:
        return self.end.t - self.start.t

    def delta(self, name: str) -> float:
        """A counter's increase; BadValue if it went backwards or vanished. A counter absent at the start is 0
        there (a labelled counter has no series before its first event: epd_proxy_requests_total)."""
        if name not in self.end.values:
            if name in self.start.values:
                raise BadValue(f"{self.end.url}: {name} vanished (restarted?)")
            return 0.0
        d = self.end.values[name] - self.start.values.get(name, 0.0)
        if d < 0:
            raise BadValue(f"{self.end.url}: {name} went backwards (restarted?)")
        return d

    def gauge(self, name: str) -> float | None:
        """A gauge's mean of the two reads (None if either lacks it)."""
        if name not in self.start.values or name not in self.end.values:
            return None
        return (self.start.values[name] + self.end.values[name]) / 2

    def histogram(self, name: str) -> Histogram:
        """A histogram's increase (buckets too, where both reads kept them); an empty one where neither has it."""
        a, b = self.start.histograms.get(name), self.end.histograms.get(name)
        if a is None and b is None:
            return Histogram(0.0, 0.0)
        if a is None or b is None:
            raise BadValue(f"{self.end.url}: {name} missing in one read")
        buckets = []
        if [le for le, _ in a.buckets] == [le for le, _ in b.buckets]:
            buckets = [(le, nb - na) for (le, na), (_, nb) in zip(a.buckets, b.buckets, strict=True)]
        d = Histogram(b.sum - a.sum, b.count - a.count, buckets)
        if d.count < 0 or d.sum < 0 or any(n < 0 for _, n in buckets):
            raise BadValue(f"{self.end.url}: {name} went backwards (restarted?)")
        return d


def spans(start: list[Scrape], end: list[Scrape]) -> tuple[list[Span], list[str]]:
    """The readable endpoints of `end` matched by URL with their read in `start`, and a reason for each endpoint that
    cannot give a window: unreadable at either end, not there at the start, or read at the start and gone at the end
    (the fleet changed: its load over the window is not known)."""
    before = {s.url: s for s in start}
    found, problems = [], []
    for b in end:
        a = before.get(b.url)
        if not b.healthy:
            continue  # listed, not taking work: not read, and no problem
        if b.error is not None:
            problems.append(b.error)
        elif a is None or not a.healthy:
            problems.append(f"{b.url}: new in this window (no read at its start)")
        elif a.error is not None:
            problems.append(a.error)
        elif b.t <= a.t:
            problems.append(f"{b.url}: its reads are not in time order")
        else:
            found.append(Span(a, b))
    after = {b.url for b in end}
    problems += [f"{a.url}: gone in this window (its work is not in the rest's)" for a in start
                 if a.url not in after and a.readable]
    return found, problems


def merged(histograms: list[Histogram]) -> Histogram:
    """The sum of histogram deltas (buckets only where every one has the same bounds)."""
    if not histograms:
        return Histogram(0.0, 0.0)
    bounds = [le for le, _ in histograms[0].buckets]
    same = bool(bounds) and all([le for le, _ in h.buckets] == bounds for h in histograms)
    buckets = [(le, sum(h.buckets[i][1] for h in histograms)) for i, le in enumerate(bounds)] if same else []
    return Histogram(sum(h.sum for h in histograms), sum(h.count for h in histograms), buckets)


def mean(h: Histogram) -> float | None:
    return h.sum / h.count if h.count > 0 else None


def quantile(h: Histogram, q: float) -> float | None:
    """The q-quantile of a histogram delta, linear within its bucket as Prometheus' histogram_quantile (the +Inf
    bucket answers the highest finite bound); None without observations or buckets."""
    if not h.buckets or h.buckets[-1][1] <= 0:
        return None
    rank = q * h.buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, cumulative in h.buckets:
        if cumulative >= rank:
            if math.isinf(le):
                return lower
            inside = cumulative - below
            return le if inside <= 0 else lower + (le - lower) * (rank - below) / inside
        lower, below = le, cumulative
    return lower
