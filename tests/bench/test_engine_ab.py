"""The engine-alone A/B benches (python -m epd_bench.attention_ab, epd_bench.fusion_ab) run both engines at each
level and print both rates and their ratio per round."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from epd_bench import attention_ab, fusion_ab


@pytest.mark.parametrize(("main", "names"), [(attention_ab.main, ("kernel", "SDPA")),
                                             (fusion_ab.main, ("fused", "unfused"))])
def test_each_level_prints_both_rates_and_their_ratio_per_round(main: Callable[[list[str]], None],
                                                                names: tuple[str, str],
                                                                tiny_model_dirs: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", str(tiny_model_dirs["llava"]), "--levels", "1,3", "--rounds", "2", "--prompt-len", "20",
          "--output-len", "8"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" in flight")[0] for line in lines] == ["1", "1", "3", "3"]
    a, b = names
    for line in lines:
        assert f": {a} " in line and f", {b} " in line and f"{a} / {b}" in line
        rate_a, rate_b, ratio = (float(x) for x in re.findall(r"\d+\.\d+", line))
        assert rate_a > 0 and rate_b > 0 and ratio == pytest.approx(rate_a / rate_b, abs=0.01)
