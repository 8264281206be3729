"""`python -m epd_bench.gpu_check --smoke` end to end on the CPU, with a fake nvidia-smi; and its pieces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from epd_bench.gpu_check import junit_counts, on_device, parse_args
from epd_bench.stacks import epd

ROOT = Path(__file__).resolve().parents[2]
FAKE_SMI = """#!/bin/sh
case "$*" in
  *compute-apps*) echo "4242, 100"; echo "4243, 7" ;;
  *memory.used*) echo "512" ;;
  *) echo "Fake GPU, 1.0, 1024" ;;
esac
"""


@pytest.mark.e2e
def test_smoke_run_records_every_step_in_at_most_eight_files(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "epd_bench.gpu_check", "--smoke", "--device", "cpu", "--out",
                           str(out), "--budget", "500"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.tar.gz"]
    record = json.loads((out / "gpu_check.json").read_text())
    steps = record["steps"]
    assert list(steps) == ["env", "tests", "model", "structured", "n-prefill", "epd-1enc", "aggregated"]
    assert all(s["ok"] for s in steps.values()) and steps["env"]["gpus"] == ["Fake GPU, 1.0, 1024"]
    assert steps["tests"]["passed"] >= 2 and steps["tests"]["failed"] == steps["tests"]["errors"] == 0
    for name in ("epd-1enc", "aggregated"):
        assert steps[name]["result"]["completed"] == 4 and steps[name]["result"]["failed"] == 0
        assert steps[name]["gpu_mib"] == {"pid 4242": 100, "pid 4243": 7}
        assert steps[name]["gpu_used_peak_mib"] == 512
    structured, n_prefill = steps["structured"]["result"], steps["n-prefill"]["result"]
    assert structured["streams"] == 2 and structured["ratio"] > 0 and n_prefill["device"] == "cpu"
    assert n_prefill["n_prefill"]["4 x n=1"]["prompt_tokens_prefilled"] == 4 * n_prefill["prompt_tokens"]
    md = (out / "gpu_check.md").read_text()
    assert "## Structured outputs" in md and "## Prefill saved by n = 4" in md
    assert "| epd-1enc | 4 / 0 |" in md and "| aggregated | 4 / 0 |" in md and "--device cpu" in md
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"work/pytest.log", "work/results/epd-1enc.json", "work/logs/aggregated-decoder.log"} <= names


def test_junit_counts_names_each_failure(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="t" name="ok"/>
      <testcase classname="t" name="bad"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>
      <testcase classname="t" name="broken"><error message="boom">tb</error></testcase>
      <testcase classname="t" name="later"><skipped message="needs CUDA"/></testcase>
    </testsuite></testsuites>""")
    counts = junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert counts["failures"] == ["t::bad: assert 1 == 2", "t::broken: boom"]


def test_workers_see_only_the_device_asked_for() -> None:
    spec = epd(Path("/models/bench"), 1, cores=2, pin=False)
    assert on_device(spec, "cuda") == spec
    assert {dict(p.env)["CUDA_VISIBLE_DEVICES"] for p in on_device(spec, "cpu").procs} == {""}
    assert {dict(p.env)["CUDA_VISIBLE_DEVICES"] for p in on_device(spec, "cuda:1").procs} == {"1"}


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda1", ""])
def test_bad_device_is_a_usage_error(device: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--out", str(tmp_path), "--device", device])
    assert exc.value.code == 2
