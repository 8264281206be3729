"""python -m epd_bench.spec_batch runs both engines at each level and prints one ratio per round."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from epd_bench.spec_batch import main


def test_each_level_prints_a_ratio_per_round(tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    main(["--model", str(tiny_model_dirs["llava"]), "--levels", "1,3", "--rounds", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" in flight")[0] for line in lines] == ["1", "3"]
    assert all(len(re.findall(r"\d+\.\d\d", line)) == 2 for line in lines)
