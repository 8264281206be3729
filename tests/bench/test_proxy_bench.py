"""epd_bench.proxy end to end on a tiny load: every target answers, and the report has its overhead, per-core
throughput, pass-through ratio and two-process scaling."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from epd_bench.micro import cpu_seconds, tree_cpu_seconds
from epd_bench.proxy import main


def test_cpu_seconds_reads_this_process() -> None:
    assert cpu_seconds(os.getpid()) > 0


def test_tree_cpu_seconds_adds_the_children() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.2: pass\n"
                                                 "time.sleep(30)"]) as child:
        try:
            deadline = time.monotonic() + 10
            while cpu_seconds(child.pid) < 0.1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert tree_cpu_seconds(os.getpid()) >= cpu_seconds(os.getpid()) + cpu_seconds(child.pid) - 0.05
        finally:
            child.kill()


def test_a_tiny_run_reports_overhead_throughput_and_scaling(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--json", "--requests", "3", "--clients", "2", "--seconds", "0.3", "--rounds", "1"])
    result = json.loads(capsys.readouterr().out)
    assert set(result["ttft_ms_p50"]) == {"direct", "passthrough", "proxy", "epd_2proc"}
    assert {"overhead_ms_p50", "rps_per_core", "ratio_vs_passthrough", "scaling_2_vs_1"} <= set(result)
    assert result["throughput"]["proxy"]["requests"] > 0 and math.isfinite(result["rps_per_core"])
    assert result["throughput"]["epd_2proc"]["requests"] > 0 and result["scaling_2_vs_1"] > 0


def test_a_tiny_traced_run_reports_tracing_off_and_on(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--json", "--requests", "3", "--clients", "2", "--seconds", "0.3", "--rounds", "1", "--tracing"])
    result = json.loads(capsys.readouterr().out)
    assert {"traced_0.01", "traced_1"} <= set(result["ttft_ms_p50"])
    for name in ("traced_0.01", "traced_1"):
        assert result["throughput"][name]["requests"] > 0
        assert math.isfinite(result["tracing"][name]["rps_per_core_vs_off"])
