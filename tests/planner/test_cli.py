"""`epd-planner` against a fake fleet on loopback: --once prints the plan, --record writes a trace that --replay
reads back, the gauge server shows the recommendation, and flag errors are one line."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from epd_common.server import uvicorn_config
from epd_planner.cli import main, parse_args
from epd_planner.planner import Planner, PlannerConfig
from epd_planner.sample import read_trace
from epd_planner.server import PlannerGauges, create_app
from tests.planner.fakes import FakeFleet, serve_fleet
from tests.ports import serve_in_thread
from tests.waiting import wait_for

KEY = "planner-test-key"


def test_once_prints_the_plan_with_the_key_sent(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the encoder busy all the time: ceil(1 / 0.7) = 2 encoders. NOTE: the fake counts busy seconds on its own clock
    # reading, the planner times its reads: a window long enough that a late answer cannot move 1.0 below 0.7
    with serve_fleet(FakeFleet(busy_share=1.0)) as fleet:
        trace = tmp_path / "trace.jsonl"
        main(["--once", "--window", "0.5", "--proxy-url", fleet.base, "--internal-key", KEY, "--record", str(trace)])
    out = capsys.readouterr().out
    # the window is the time between the two reads as measured: at least the 0.5 s asked, more on a busy machine
    measured = re.match(r"window ([0-9.]+) s:", out)
    assert measured is not None and float(measured.group(1)) >= 0.5, out
    assert "encoder  1 -> 2" in out and "decoder  1 -> 1" in out and "prefill  0 -> 0" in out, out
    assert "headroom:" in out and "why: utilisation" in out
    assert fleet.seen_auth == [f"Bearer {KEY}"] * 2
    samples = read_trace(trace.read_text())
    assert len(samples) == 2 and samples[1].replicas("encoder") == 1
    main(["--replay", str(trace)])
    replayed = capsys.readouterr().out
    assert replayed.startswith("== window 1\n") and "encoder  1 -> 2" in replayed


def test_the_gauge_server_shows_the_recommendation_per_role() -> None:
    with serve_fleet(FakeFleet(busy_share=1.0)) as fleet:
        planner = Planner(PlannerConfig(proxy_url=fleet.base, internal_key=KEY, window=0.5))
        app = create_app(planner)
        with serve_in_thread(uvicorn_config(app, "127.0.0.1", 0, "warning")) as port:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: planner.latest()[1] >= 1, "a window decided")
            text = httpx.get(f"{url}/metrics", timeout=10).text
            health = httpx.get(f"{url}/health", timeout=10).json()
    assert 'epd_planner_desired_replicas{role="encoder"} 2.0' in text, text
    assert 'epd_planner_desired_replicas{role="decoder"} 1.0' in text
    assert 'epd_planner_current_replicas{role="encoder"} 1.0' in text
    assert 'epd_planner_unreadable{role="encoder"} 0.0' in text
    assert health["status"] == "ok" and health["desired"]["encoder"] == 2 and "reasons" not in health


def test_the_gauge_server_exports_no_desired_count_before_a_window_or_for_an_unreadable_role() -> None:
    fleet = FakeFleet()
    fleet.answers["/encoder-0/metrics"] = lambda: (500, b"oops")
    with serve_fleet(fleet):
        planner = Planner(PlannerConfig(proxy_url=fleet.base, window=0.05))
        app = create_app(planner)
        assert [m.name for m in PlannerGauges(planner).collect()] == ["epd_planner_windows"]  # nothing read yet
        with serve_in_thread(uvicorn_config(app, "127.0.0.1", 0, "warning")) as port:
            wait_for(lambda: planner.latest()[1] >= 1, "a window decided")
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'epd_planner_desired_replicas{role="encoder"}' not in text
    assert 'epd_planner_desired_replicas{role="decoder"} 1.0' in text
    assert 'epd_planner_unreadable{role="encoder"} 1.0' in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--replay", "x", "--once"], "--replay reads a trace"),
    (["--min-encoders", "3", "--max-encoders", "2"], "--min-encoders <= --max-encoders"),
    (["--window", "0"], "must be a number > 0"),
    (["--target-utilization", "1.5"], "must be in (0, 1]"),
])
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_replaying_a_file_that_is_not_a_trace_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit) as exc:
        main(["--replay", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("epd-planner: error: --replay: ")
    with pytest.raises(SystemExit):
        main(["--replay", str(tmp_path / "missing.jsonl")])
    assert "cannot read" in capsys.readouterr().err
