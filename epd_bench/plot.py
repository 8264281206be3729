"""PNG plots of epd-bench results (matplotlib, headless): latency CDFs and TTFT over time.

Each function takes one or more labelled runs, so epd-bench plots its own run and the comparison
overlays several systems on the same axes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # NOTE: no display on servers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from epd_bench.metrics import METRIC_TITLES  # noqa: E402

# metric -> the per-request list in a result JSON (seconds)
SERIES = {"ttft": "ttfts", "tpot": "tpots", "itl": "itls", "e2el": "e2els"}


def _cdf(ax: Any, values_s: list[float], label: str) -> None:
    ms = sorted(v * 1000.0 for v in values_s if v > 0)  # log axis: a 0 (no gap measured) cannot be drawn
    if ms:
        ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=label)


def plot_latency_cdfs(runs: dict[str, dict[str, Any]], path: Path, metrics: tuple[str, ...] = tuple(SERIES)) -> Path:
    """One panel per metric, one CDF line per run (runs: label -> result JSON)."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, result in runs.items():
            values = result.get(SERIES[metric], [])
            _cdf(ax, [v for row in values for v in row] if metric == "itl" else values, label)
        ax.set_title(METRIC_TITLES[metric], fontsize=9)
        ax.set_xscale("log")  # systems differ by orders of magnitude; a linear axis hides the fast ones
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("share of requests" if metric != "itl" else "share of gaps")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def plot_ttft_over_time(runs: dict[str, dict[str, Any]], path: Path) -> Path:
    """TTFT of each request against the time it was sent, one series per run."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for label, result in runs.items():
        ok = sorted((t, f * 1000.0) for t, f, good in zip(result["start_times"], result["ttfts"], result["successes"],
                                                          strict=True) if good and f > 0)
        ax.plot([t for t, _ in ok], [f for _, f in ok], marker=".", linestyle="-", linewidth=0.6, label=label)
    ax.set_xlabel("request sent at (s since start)")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: regenerated files diff cleanly
    plt.close(fig)
    return path
