"""The encoder batching benchmark runs end to end on a tiny model: both systems measured, the batched rounds
reached batches of more than one image, the unbatched ones never did."""
from __future__ import annotations

from pathlib import Path

from epd_bench.encoder_batching import run


def test_the_benchmark_measures_both_systems_and_reports_the_batches(tiny_model_dirs: dict[str, Path]) -> None:
    out = run(str(tiny_model_dirs["llava"]), concurrency=4, rounds=2, size=64)
    assert set(out["images_per_s"]) == {"batched", "unbatched"} and out["batched_vs_unbatched"] > 0
    assert max(out["batch_sizes"]) > 1 and all(len(v) == 2 for v in out["rounds_images_per_s"].values())
