"""python -m epd_bench.attention_ab runs the kernel and the SDPA engine at each level and prints both rates and their
ratio per round."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from epd_bench.attention_ab import main


def test_each_level_prints_both_rates_and_their_ratio_per_round(tiny_model_dirs: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", str(tiny_model_dirs["llava"]), "--levels", "1,3", "--rounds", "2", "--prompt-len", "20",
          "--output-len", "8"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" in flight")[0] for line in lines] == ["1", "1", "3", "3"]
    for line in lines:
        kernel, sdpa, ratio = (float(x) for x in re.findall(r"\d+\.\d+", line))
        assert kernel > 0 and sdpa > 0 and ratio == pytest.approx(kernel / sdpa, abs=0.01)
