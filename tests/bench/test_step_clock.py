"""The decoder benchmark's step clock (epd_bench/step_clock.py) on today's engine: it finds the read-back functions
the step calls and the per-row `accept` (engine/postprocess.py), so the host cost's phases are measured, not empty.
It once looked for them on the engine's own class and module, which the engine's split into a layer moved."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from epd_bench.decoder_worker import Bench, decoder_config
from epd_builders.tiny import TinySpec, build_tiny


def test_the_step_clock_times_every_phase_of_a_decode_step(tmp_path: Path) -> None:
    bench = Bench(build_tiny(TinySpec(family="llava"), tmp_path / "tiny"), decoder_config(max_num_seqs=4,
                                                                                          max_model_len=512),
                  vision=False)
    try:
        out = asyncio.run(bench.host_cost(4, max_tokens=12))
    finally:
        bench.close()
    assert out is not None and out["steps"] > 0, out
    assert out["phases_us_per_row"]["read_back"] > 0 and out["phases_us_per_row"]["forward"] > 0, out
    split = out["postprocess_split_us_per_row"]
    assert split["accept"] > 0 and split["detokenize"] > 0, split
    accept = sys.modules["decoder_service.engine.postprocess"].accept
    assert not hasattr(accept, "__wrapped__"), "the per-row hooks are undone after the run"
