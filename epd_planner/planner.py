"""The planning loop: read the fleet every window, decide, pass the decision through the hysteresis, keep the
latest for the gauges (`Planner`); and the two one-shot uses of it, `once` (two reads a window apart) and
`replay` (every window of a recorded trace, no network)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from epd_planner.hysteresis import Hysteresis
from epd_planner.model import Bounds, Decision, Targets, decide
from epd_planner.sample import Sample
from epd_planner.signals import collect

logger = logging.getLogger("epd.planner")


@dataclass(frozen=True)
class PlannerConfig:
    proxy_url: str = "http://127.0.0.1:8000"
    internal_key: str | None = field(default=None, repr=False)
    window: float = 30.0  # seconds between reads
    timeout: float = 2.0  # seconds one HTTP read may take
    all_addresses: bool = False  # read every address the proxy's host resolves to
    targets: Targets = field(default_factory=Targets)
    bounds: Bounds = field(default_factory=Bounds)
    up_windows: int = 1
    down_windows: int = 3
    margin: float = 0.1
    record: str | None = None  # append each sample to this file, a JSON line each
    down_step: float = 0.1  # the most replicas one step down removes, as a share of the count

    def __post_init__(self) -> None:
        assert self.window > 0 and self.timeout > 0, "window and timeout must be > 0"

    def hysteresis(self) -> Hysteresis:
        return Hysteresis(self.bounds, self.up_windows, self.down_windows, self.margin, self.down_step)


@dataclass(frozen=True)
class Step:
    """One window's outcome."""

    decision: Decision
    recommended: dict[str, int]  # after the hysteresis: what the gauges show


class Planner:
    """Reads, decides and remembers; `step` is called once per window (the loop in `run`, or a test)."""

    def __init__(self, cfg: PlannerConfig, read: Callable[[], Sample] | None = None) -> None:
        self.cfg = cfg
        self.read = read or (lambda: collect(cfg.proxy_url, cfg.internal_key, cfg.timeout, cfg.all_addresses))
        self.hysteresis = cfg.hysteresis()
        self.prev: Sample | None = None
        self.last: Step | None = None
        self.windows = 0
        self.lock = threading.Lock()  # `last` is read by /metrics on the server's thread

    def step(self) -> Step | None:
        """Read the fleet; with a read from the window before, decide (None on the first read)."""
        sample = self.read()
        if self.cfg.record:
            record(self.cfg.record, sample)
        prev, self.prev = self.prev, sample
        if prev is None:
            return None
        decision = decide(prev, sample, self.cfg.targets, self.cfg.bounds)
        done = Step(decision, self.hysteresis.update(decision))
        with self.lock:
            self.last, self.windows = done, self.windows + 1
        logger.info("window %d: %s", self.windows, "; ".join(
            f"{r} {p.current} -> {done.recommended[r]} ({p.reason})" for r, p in decision.plans.items()))
        return done

    def latest(self) -> tuple[Step | None, int]:
        with self.lock:
            return self.last, self.windows

    def run(self, stop: threading.Event, then: Callable[[Step], object] | None = None) -> None:
        """A step every window until `stop` is set, each decision handed to `then` (the launcher's --autoscale
        follows it); a step that fails is logged and the loop goes on."""
        deadline = time.monotonic()
        while not stop.is_set():
            try:
                done = self.step()
                if done is not None and then is not None:
                    then(done)
            except Exception:  # noqa: BLE001 (the gauges keep the last good window; the log says why)
                logger.exception("planning step failed")
            deadline = max(deadline + self.cfg.window, time.monotonic())
            stop.wait(deadline - time.monotonic())


def record(path: str, sample: Sample) -> None:
    """Append the sample to a trace file as one JSON line."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(sample.to_json() + "\n")


def once(cfg: PlannerConfig, wait: Callable[[float], object] = time.sleep) -> Step:
    """Two reads `cfg.window` seconds apart, and the decision on that window."""
    planner = Planner(cfg)
    planner.step()
    wait(cfg.window)
    done = planner.step()
    assert done is not None, "the second step decides"
    return done


def replay(samples: list[Sample], cfg: PlannerConfig) -> Iterator[Step]:
    """The steps a recorded trace gives, one per pair of consecutive samples (the window they were recorded at)."""
    hysteresis = cfg.hysteresis()
    for prev, cur in zip(samples, samples[1:], strict=False):
        decision = decide(prev, cur, cfg.targets, cfg.bounds)
        yield Step(decision, hysteresis.update(decision))
