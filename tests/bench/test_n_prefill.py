"""epd_bench.n_prefill on the tiny model: one n = 4 request prefills its prompt once, four n = 1 requests four times."""
from __future__ import annotations

from pathlib import Path

from epd_bench.n_prefill import run


def test_n4_prefills_the_prompt_once_and_four_singles_four_times(tiny_model_dirs: dict[str, Path]) -> None:
    out = run(str(tiny_model_dirs["llava"]), device="cpu", image_tokens=16, words=8, repeats=1)
    rows, tokens = out["n_prefill"], out["prompt_tokens"]
    assert rows["n=4 (one request)"]["prompt_tokens_prefilled"] == tokens
    assert rows["4 x n=1"]["prompt_tokens_prefilled"] == 4 * tokens
    assert out["kv_to_a_second_slot"]["prompt_tokens"] == tokens
    assert all(row["first_token_of_all_4_ms"] > 0 for row in rows.values())
