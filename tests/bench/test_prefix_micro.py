"""The prefix-cache micro-benchmark: publishing held prefixes by /health summary vs events (epd_bench.prefix_publish
and prefix_events); tiny sizes, through its main(argv)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from epd_bench import prefix_publish


def _run(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    main(argv)
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_prefix_publish_reports_summary_and_events_costs(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(prefix_publish.main, ["--json", "--keys", "16", "128", "--churn", "10", "100", "--zmq-events", "50",
                                     "--budget", "0", "--probe-budget", "0"], capsys)
    s, e = out["summary_S"], out["events_E"]
    assert [r["keys"] for r in s["rows"]] == [16, 128]
    for r in s["rows"]:
        # each key is 32 hex characters, quoted, comma-separated in the /health JSON
        assert r["key_bytes_per_probe"] == 35 * r["keys"] - 1
        assert r["bytes_per_s"] == pytest.approx(r["key_bytes_per_probe"] / s["interval_s"], abs=0.1)
        assert r["probe_cpu_us"] > 0 and r["probe_wall_us"] > 0 and r["marginal_cpu_us"] >= 0
        assert min(r["json_dumps_us"], r["json_loads_us"], r["msgspec_encode_us"], r["set_rebuild_us"]) > 0
    assert s["staleness_s"]["max"] == s["interval_s"]
    assert e["per_event"]["one_key"]["bytes"] > e["per_event"]["heartbeat"]["bytes"] > 0
    assert e["per_event"]["one_key"]["encode_us"] > 0 and e["per_event"]["one_key"]["decode_apply_us"] > 0
    for mode in ("burst", "paced"):
        assert e["zmq_tcp_loopback"][mode]["events"] == 50 and e["zmq_tcp_loopback"][mode]["wall_us_per_event"] > 0
    slow, fast = e["rows"]
    assert (slow["churn_per_s"], fast["churn_per_s"]) == (10, 100)
    assert 0 < slow["per_key"]["bytes_per_s"] < fast["per_key"]["bytes_per_s"]  # grows with R
    assert 0 < slow["per_key"]["cpu_us_per_s"] < fast["per_key"]["cpu_us_per_s"]
    assert fast["batched"]["keys_per_event"] == 10 and fast["batched"]["bytes_per_s"] < fast["per_key"]["bytes_per_s"]
    small, big = e["snapshot"]
    assert (small["keys"], big["keys"]) == (16, 128) and 0 < small["bytes"] < big["bytes"]  # grows with K
    assert "K=128 R=100/s" in out["conclusion"]
