"""What one read of the fleet holds: the proxy's and each worker's kept metrics at one moment (`Sample`), as a JSON
line so a trace can be recorded and replayed. Plain data, no I/O; a value that is not a finite number in [0, HUGE]
never gets in (`checked_value`): the read of that endpoint is an error instead."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

ROLES = ("encoder", "prefill", "decoder")  # the worker roles, as the proxy's /instances names them (+ "s")
HUGE = 1e15  # no counter of ours gets near this: larger is garbage (seconds, tokens, blocks)


class BadValue(ValueError):
    """A metric that no healthy worker exports: NaN, infinite, negative, huge, or a histogram that does not add up."""


def checked_value(name: str, value: float) -> float:
    """`value` as a float, or BadValue naming the metric."""
    number = float(value)
    if not math.isfinite(number) or not 0 <= number <= HUGE:
        raise BadValue(f"{name} = {value!r}: not a finite number in [0, {HUGE:g}]")
    return number


@dataclass
class Histogram:
    """A Prometheus histogram's cumulative state; `buckets` only where a quantile is taken from it."""

    sum: float
    count: float
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count), +Inf last

    def check(self, name: str) -> None:
        """BadValue unless every number is sane and the buckets are cumulative and end at `count`."""
        checked_value(f"{name}_sum", self.sum)
        checked_value(f"{name}_count", self.count)
        last = 0.0
        for le, n in self.buckets:
            if math.isnan(le) or checked_value(f"{name}_bucket", n) < last:
                raise BadValue(f"{name}: buckets are not cumulative")
            last = n
        if self.buckets and (self.buckets[-1][0] != math.inf or self.buckets[-1][1] != self.count):
            raise BadValue(f"{name}: the +Inf bucket is not the count")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"sum": self.sum, "count": self.count}
        if self.buckets:
            d["buckets"] = [["+Inf" if math.isinf(le) else le, n] for le, n in self.buckets]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Histogram:
        return cls(float(d["sum"]), float(d["count"]), [(float(le), float(n)) for le, n in d.get("buckets", [])])


@dataclass
class Scrape:
    """One endpoint read at one moment: the proxy's /metrics, or a worker's (a decoder's /health too)."""

    url: str
    role: str  # "proxy", or one of ROLES
    t: float  # monotonic seconds when it was read
    healthy: bool = True  # as /instances said; an unhealthy worker is listed, not read
    error: str | None = None  # why it could not be read: then values and histograms are empty
    values: dict[str, float] = field(default_factory=dict)  # counters (`_total`) and gauges, summed over labels
    histograms: dict[str, Histogram] = field(default_factory=dict)

    @property
    def readable(self) -> bool:
        return self.healthy and self.error is None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "role": self.role, "t": self.t, "healthy": self.healthy}
        if self.error is not None:
            d["error"] = self.error
        if self.values:
            d["values"] = self.values
        if self.histograms:
            d["histograms"] = {k: h.to_dict() for k, h in self.histograms.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scrape:
        return cls(str(d["url"]), str(d["role"]), float(d["t"]), bool(d.get("healthy", True)), d.get("error"),
                   {k: float(v) for k, v in d.get("values", {}).items()},
                   {k: Histogram.from_dict(h) for k, h in d.get("histograms", {}).items()})


@dataclass
class Sample:
    """The fleet at one moment: every proxy read, and every worker /instances lists (healthy ones read)."""

    t: float  # monotonic seconds (the read's start)
    wall: float  # Unix seconds, for the reader of a trace
    proxies: list[Scrape] = field(default_factory=list)
    workers: list[Scrape] = field(default_factory=list)
    error: str | None = None  # /instances could not be read: the workers are unknown

    def replicas(self, role: str) -> int:
        """Workers of `role` that /instances lists, healthy or not."""
        return sum(1 for w in self.workers if w.role == role)

    def of(self, role: str) -> list[Scrape]:
        return [w for w in self.workers if w.role == role]

    def to_json(self) -> str:
        """One line of JSON (no NaN or Infinity: every kept value is checked finite)."""
        d: dict[str, Any] = {"t": self.t, "wall": self.wall, "proxies": [p.to_dict() for p in self.proxies],
                             "workers": [w.to_dict() for w in self.workers]}
        if self.error is not None:
            d["error"] = self.error
        return json.dumps(d, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, line: str) -> Sample:
        d = json.loads(line)
        return cls(float(d["t"]), float(d["wall"]), [Scrape.from_dict(p) for p in d.get("proxies", [])],
                   [Scrape.from_dict(w) for w in d.get("workers", [])], d.get("error"))


def read_trace(text: str) -> list[Sample]:
    """The samples of a recorded trace (one JSON line each; blank lines skipped)."""
    return [Sample.from_json(line) for line in text.splitlines() if line.strip()]
