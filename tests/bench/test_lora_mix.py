"""python -m epd_bench.lora_mix: writes adapters `--lora-modules` reads, and prints each round's rates and the ratio."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from epd_bench.lora_mix import main, write_adapter
from epd_models.halves import LanguageHalf
from epd_models.lora.peft_format import linear_shapes, read_adapter


def test_its_adapters_are_read_as_peft_adapters(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    lm = LanguageHalf(tiny_model_dirs["llava"])
    shapes = linear_shapes(lm.module)
    adapter = read_adapter("x", write_adapter(tmp_path / "x", shapes, 4, 0), family=lm.adapter, shapes=shapes,
                           max_rank=16, dtype=torch.float32)
    assert set(adapter.weights) == set(shapes) and adapter.rank == 4


def test_it_prints_each_rounds_rates_and_the_ratio(tiny_model_dirs: dict[str, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", str(tiny_model_dirs["llava"]), "--adapters", "3", "--rank", "8", "--in-flight", "4",
          "--rounds", "2", "--prompt-len", "12", "--output-len", "4"])
    out = capsys.readouterr().out
    assert len(re.findall(r"round \d: base \d+\.\d tok/s, 3 adapters mixed \d+\.\d tok/s", out)) == 2
    assert float(re.search(r"4 in flight: (\d+\.\d+) \(median of 2 rounds\)", out).group(1)) > 0
