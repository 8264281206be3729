"""epd-bench's summary of a run: throughput, goodput and latency statistics, named as `vllm bench serve` names them.

Besides vLLM's fields: cached prompt tokens (what a prefix or embedding cache let the server skip), and the
multi-turn workload's split of TTFT by turn (turn 1 has no history to reuse; turns 2+ resend it all).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epd_bench.backends import RequestOutput

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float  # seconds, first request sent -> last answer
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    request_goodput: float | None  # requests/s meeting every SLO; None without --goodput
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    latency: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> mean/median/std/pXX, ms
    mean_cached_tokens: float = 0.0  # usage.prompt_tokens_details.cached_tokens, per successful request
    # successful requests by turn (None: no such request; every request is turn 1 outside multi-turn)
    mean_ttft_ms_turn1: float | None = None
    mean_ttft_ms_turn2plus: float | None = None
    mean_cached_tokens_turn2plus: float | None = None
    mean_prompt_tokens_turn2plus: float | None = None

    def to_json(self) -> dict[str, Any]:
        flat: dict[str, Any] = {k: v for k, v in self.__dict__.items() if k != "latency"}
        for metric, stats in self.latency.items():
            for stat, value in stats.items():
                flat[f"{stat}_{metric}_ms"] = value
        return flat


def percentile_key(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's key names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def tpot(out: RequestOutput) -> float:
    """Seconds per output token after the first; 0 for a one-token answer."""
    return (out.latency - out.ttft) / (out.output_tokens - 1) if out.output_tokens > 1 else 0.0


def _stats(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    stats.update({percentile_key(p): float(np.percentile(ms, p)) for p in percentiles})
    return stats


def is_good(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every SLO given (ttft, tpot, e2el in ms)."""
    values = {"ttft": out.ttft, "tpot": tpot(out), "e2el": out.latency}
    return out.success and all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def turn_means(ok: list[RequestOutput]) -> dict[str, float | None]:
    """BenchmarkMetrics' per-turn fields for these successful requests."""
    later = [o for o in ok if o.turn >= 2]
    return {"mean_ttft_ms_turn1": _mean([o.ttft * 1000.0 for o in ok if o.turn == 1]),
            "mean_ttft_ms_turn2plus": _mean([o.ttft * 1000.0 for o in later]),
            "mean_cached_tokens_turn2plus": _mean([float(o.cached_tokens) for o in later]),
            "mean_prompt_tokens_turn2plus": _mean([float(o.prompt_tokens) for o in later])}


def calculate_metrics(outputs: list[RequestOutput], duration: float, percentiles: list[float],
                      slos_ms: dict[str, float] | None = None,
                      selected: tuple[str, ...] = LATENCY_METRICS) -> BenchmarkMetrics:
    ok = [o for o in outputs if o.success]
    samples = {"ttft": [o.ttft for o in ok], "tpot": [tpot(o) for o in ok if o.output_tokens > 1],
               "itl": [gap for o in ok for gap in o.itl], "e2el": [o.latency for o in ok]}
    total_in, total_out = sum(o.prompt_tokens for o in ok), sum(o.output_tokens for o in ok)
    goodput = None if slos_ms is None else sum(is_good(o, slos_ms) for o in ok) / duration
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), duration=duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration, request_goodput=goodput,
        output_throughput=total_out / duration, total_token_throughput=(total_in + total_out) / duration,
        latency={m: _stats(samples[m], percentiles) for m in selected},
        mean_cached_tokens=_mean([float(o.cached_tokens) for o in ok]) or 0.0, **turn_means(ok),
    )


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0}; names checked, values must be > 0."""
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes NAME:MS with NAME one of ttft, tpot, e2el; got {item!r}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"--goodput {name} must be > 0 ms; got {value}")
    return slos


def format_report(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The console table, laid out like vLLM's."""
    lines = [f"{f' {title} ':=^60}"]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<44}{value:>16}" if isinstance(value, int) else f"{label:<44}{value:>16.2f}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    row("Mean cached prompt tokens:", m.mean_cached_tokens)
    if m.mean_ttft_ms_turn2plus is not None:
        lines.append(f"{' Multi-turn ':-^60}")
        row("Mean TTFT, turn 1 (ms):", m.mean_ttft_ms_turn1 or 0.0)
        row("Mean TTFT, turns 2+ (ms):", m.mean_ttft_ms_turn2plus)
        row("Mean prompt tokens, turns 2+:", m.mean_prompt_tokens_turn2plus or 0.0)
        row("Mean cached prompt tokens, turns 2+:", m.mean_cached_tokens_turn2plus or 0.0)
    for metric, stats in m.latency.items():
        lines.append(f"{' ' + METRIC_TITLES[metric] + ' ':-^60}")
        for stat, value in stats.items():
            if stat not in ("std", "p50"):  # p50 is the median, printed above it
                row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {metric.upper()} (ms):",
                    value)
    lines.append("=" * 60)
    return "\n".join(lines)
