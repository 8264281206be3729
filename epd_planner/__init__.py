"""epd-planner: how many encoders, prefill workers and decoders a fleet needs, from its workers' own live metrics,
against a TTFT and ITL target. Torch-free: it only reads HTTP (/instances, /metrics, a decoder's /health).

- `epd_planner.sample`: what one read of the fleet holds (`Sample`), as JSON lines for traces
- `epd_planner.signals`: `collect`, the read itself
- `epd_planner.window`: deltas and quantiles between two samples
- `epd_planner.model`: `decide`, the plan for one window (pure)
- `epd_planner.hysteresis`: `Hysteresis`, so the plan does not flap
- `epd_planner.cli`: the `epd-planner` console script (`--once`, `--record`, `--replay`, the gauge server)
"""
