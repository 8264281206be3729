"""Reading epd-bench result JSON back, and merging the rounds of one system into one result.

The comparison runs each workload in rounds that alternate the order of the systems (A B C, then C B A),
so load from other users of a shared machine lands on every system alike; merging pools the requests and
adds up the durations, so throughput is total tokens over total time.
"""
from __future__ import annotations

from typing import Any

from epd_bench.backends import RequestOutput
from epd_bench.metrics import calculate_metrics, tpot

PERCENTILES = [50.0, 90.0, 99.0]


def outputs_from_result(result: dict[str, Any], time_offset: float = 0.0) -> list[RequestOutput]:
    """The per-request records of a result JSON as RequestOutputs (start times shifted by time_offset)."""
    n = len(result["successes"])  # turns and cached tokens: absent from results saved before they were recorded
    rows = zip(result["successes"], result["ttfts"], result["itls"], result["e2els"], result["output_lens"],
               result["input_lens"], result["start_times"], result["errors"], result.get("turns", [1] * n),
               result.get("cached_tokens", [0] * n), strict=True)
    return [RequestOutput(success=ok, ttft=ttft, itl=list(itl), latency=e2el, output_tokens=out, prompt_tokens=inp,
                          start_time=start + time_offset, error=err, turn=turn, cached_tokens=cached)
            for ok, ttft, itl, e2el, out, inp, start, err, turn, cached in rows]


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of the same workload on the same system, run one after another."""
    outputs: list[RequestOutput] = []
    offset = 0.0
    for part in parts:
        outputs += outputs_from_result(part, offset)
        offset += float(part["duration"])
    metrics = calculate_metrics(outputs, offset, PERCENTILES).to_json()
    return {**metrics, "rounds": len(parts), "num_prompts": len(outputs),
            "input_lens": [o.prompt_tokens for o in outputs], "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft for o in outputs], "tpots": [tpot(o) for o in outputs], "itls": [o.itl for o in outputs],
            "e2els": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
            "successes": [o.success for o in outputs], "errors": [o.error for o in outputs],
            "turns": [o.turn for o in outputs], "cached_tokens": [o.cached_tokens for o in outputs]}
