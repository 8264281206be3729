"""python -m epd_bench.step_times times each step by kind under each prefill split, and leaves the runner's split as
it found it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import decoder_service.engine.model_runner as model_runner
from decoder_service.engine.fairness import split_prefill_budget
from epd_bench.step_times import equal_parts, first_come_first_served, main


def test_first_come_first_served_fills_the_budget_in_admission_order() -> None:
    assert first_come_first_served({"a": 100, "b": 100, "c": 100}, 150, 16) == {"a": 100, "b": 50}
    assert first_come_first_served({"a": 10, "b": 300}, 2048, 16) == {"a": 10, "b": 300}
    assert first_come_first_served({"a": 10}, 0, 16) == {}
    assert split_prefill_budget({"a": 100, "b": 100, "c": 100}, 150, 16) == {"a": 50, "b": 50, "c": 50}


def test_the_equal_split_gives_every_prompt_a_sliver_where_the_runner_gives_an_eighth_each() -> None:
    burst = {i: 256 for i in range(64)}
    assert set(equal_parts(burst, 2048, 16).values()) == {32}
    runner = split_prefill_budget(burst, 2048, 16)
    assert list(runner.values()) == [256] * 8 + [0] * 56


def test_each_split_prints_its_rate_and_step_times_and_the_runner_keeps_its_split(
        tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", str(tiny_model_dirs["llava"]), "--in-flight", "3", "--rounds", "1", "--prompt-len", "20",
          "--output-len", "6", "--profile-step", "1"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 0 runner", "round 0 equal", "round 0 fcfs"]
    for line in lines:
        assert float(re.search(r": (\d+\.\d+) tok/s", line).group(1)) > 0
        assert re.search(r"prefill [1-9]\d* steps", line) and re.search(r"decode [1-9]\d* steps", line)
    assert "Self CPU" in out  # the profiled step's table
    assert model_runner.split_prefill_budget is split_prefill_budget
