"""epd-bench end to end against a fake streaming server on loopback: timings, JSON, plots, load shapes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_bench.serve import run
from tests.bench.conftest import FakeBehaviour, FakeServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(fake: FakeServer, *flags: str) -> dict:
    return run(["--base-url", fake.url, "--disable-tqdm", "--random-input-len", "8", *flags])


def test_streaming_timings_come_from_the_text_chunks(fake_server: FakeServer) -> None:
    r = bench(fake_server, "--num-prompts", "4", "--random-output-len", "5", "--images-per-request", "2",
              "--image-size", "32x24")
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["model_id"] == "fake-model"  # found through GET /v1/models
    # the empty role chunk sent before generation is not the first token
    assert all(t >= fake_server.behaviour.ttft_s for t in r["ttfts"])
    assert r["output_lens"] == [5] * 4 and r["input_lens"] == [210] * 4  # from usage
    assert all(len(itl) == 4 for itl in r["itls"])  # 5 chunks -> 4 gaps
    assert all(e >= t + sum(itl) - 1e-6 for e, t, itl in zip(r["e2els"], r["ttfts"], r["itls"], strict=True))
    assert r["total_output_tokens"] == 20 and r["output_throughput"] == pytest.approx(20 / r["duration"])
    for key in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p50_itl_ms",
                "mean_e2el_ms", "std_ttft_ms"):
        assert key in r
    body = fake_server.bodies[0]
    assert body["stream"] is True and body["max_tokens"] == 5 and "ignore_eos" not in body
    images = [p for p in body["messages"][0]["content"] if p["type"] == "image_url"]
    assert len(images) == 2 and images[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")


@pytest.mark.parametrize("fake_server", [FakeBehaviour(usage=False, done_line=False)], indirect=True)
def test_a_server_without_usage_or_done_line_still_counts(fake_server: FakeServer) -> None:
    """transformers serve ends the body without [DONE]; without usage, tokens are counted by chunk."""
    r = bench(fake_server, "--num-prompts", "3", "--random-output-len", "4", "--images-per-request", "0")
    assert r["completed"] == 3 and r["output_lens"] == [4, 4, 4] and r["input_lens"] == [0, 0, 0]


def test_flags_reach_the_request(fake_server: FakeServer) -> None:
    bench(fake_server, "--num-prompts", "2", "--random-output-len", "3", "--images-per-request", "0",
          "--model", "fake-model", "--api-key", "k", "--ignore-eos", "--extra-body", '{"logit_bias": {"2": -100.0}}',
          "--temperature", "0.5", "--num-warmups", "1")
    assert len(fake_server.bodies) == 3  # one warm-up, then two measured
    body = fake_server.bodies[-1]
    assert body["model"] == "fake-model" and body["ignore_eos"] is True and body["logit_bias"] == {"2": -100.0}
    assert body["temperature"] == 0.5 and body["stream_options"] == {"include_usage": True}
    assert set(fake_server.auth) == {"Bearer k"}


@pytest.mark.parametrize("fake_server", [FakeBehaviour(fail_every=3)], indirect=True)
def test_failed_requests_are_counted_not_timed(fake_server: FakeServer) -> None:
    r = bench(fake_server, "--num-prompts", "6", "--random-output-len", "2", "--images-per-request", "0")
    assert (r["completed"], r["failed"]) == (4, 2)
    assert [bool(e) for e in r["errors"]] == [not ok for ok in r["successes"]]
    assert all("HTTP 500" in e for e in r["errors"] if e)


@pytest.mark.parametrize("fake_server", [FakeBehaviour(ttft_s=0.05)], indirect=True)
def test_max_concurrency_caps_requests_in_flight(fake_server: FakeServer) -> None:
    bench(fake_server, "--num-prompts", "6", "--random-output-len", "2", "--images-per-request", "0",
          "--max-concurrency", "2")
    assert fake_server.max_in_flight == 2


@pytest.mark.parametrize("fake_server", [FakeBehaviour(ttft_s=0.05)], indirect=True)
def test_request_rate_inf_sends_everything_at_once(fake_server: FakeServer) -> None:
    r = bench(fake_server, "--num-prompts", "5", "--random-output-len", "2", "--images-per-request", "0")
    assert fake_server.max_in_flight == 5 and max(r["start_times"]) < 0.05


def test_poisson_send_times_follow_the_seeded_schedule(fake_server: FakeServer) -> None:
    from epd_bench.serve import arrival_offsets

    r = bench(fake_server, "--num-prompts", "5", "--random-output-len", "1", "--images-per-request", "0",
              "--request-rate", "50", "--seed", "7")
    planned = arrival_offsets(5, 50.0, 1.0, 7)
    assert all(sent >= plan - 1e-3 for sent, plan in zip(r["start_times"], planned, strict=True))
    assert r["request_rate"] == 50.0 and r["duration"] >= planned[-1]


def test_goodput_counts_requests_within_every_slo(fake_server: FakeServer) -> None:
    loose = bench(fake_server, "--num-prompts", "3", "--random-output-len", "2", "--images-per-request", "0",
                  "--goodput", "ttft:60000", "e2el:60000")
    tight = bench(fake_server, "--num-prompts", "3", "--random-output-len", "2", "--images-per-request", "0",
                  "--goodput", "ttft:1")  # the fake server waits 20 ms before the first token
    assert loose["request_goodput"] == pytest.approx(loose["request_throughput"])
    assert tight["request_goodput"] == 0.0 and tight["goodput_slos_ms"] == {"ttft": 1.0}


def test_save_result_and_plots(fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(fake_server, "--num-prompts", "3", "--random-output-len", "3", "--save-result", "--result-dir",
              str(tmp_path), "--result-filename", "out.json", "--plot", str(tmp_path / "plots"), "--save-detailed")
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["ttfts"] == r["ttfts"] and saved["generated_texts"] == ["t0 t1 t2 "] * 3
    assert saved["dataset"]["num_prompts"] == 3 and saved["request_rate"] == "inf"
    for name in ("latency_cdf.png", "ttft_over_time.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    report = capsys.readouterr().out
    assert "Successful requests:" in report and "Mean TTFT (ms):" in report and "P99 ITL (ms):" in report


def test_default_result_filename(fake_server: FakeServer, tmp_path: Path) -> None:
    bench(fake_server, "--num-prompts", "1", "--random-output-len", "1", "--save-result", "--result-dir",
          str(tmp_path), "--label", "x", "--request-rate", "5")
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("x-openai-chat-5.0qps-fake-model-")


def test_epd_decoder_backend_talks_ndjson(fake_server: FakeServer) -> None:
    r = run(["--backend", "epd-decoder", "--base-url", fake_server.url, "--disable-tqdm", "--num-prompts", "2",
             "--random-output-len", "3", "--images-per-request", "1", "--image-size", "16", "--ignore-eos"])
    assert r["completed"] == 2 and r["output_lens"] == [3, 3] and r["model_id"] is None
    body = fake_server.bodies[0]
    assert body["sampling"]["ignore_eos"] is True and body["sampling"]["max_tokens"] == 3
    assert body["messages"][0]["content"][0] == {"type": "image"}
    (image,) = body["images"]
    assert len(image["mm_hash"]) == 64 and image["data"]  # inline, for an aggregated decoder


@pytest.mark.parametrize("bad", [["--goodput", "ttft"], ["--goodput", "foo:3"], ["--goodput", "ttft:0"],
                                 ["--percentile-metrics", "ttft,xyz"], ["--request-rate", "0"],
                                 ["--max-concurrency", "0"], ["--repeat-ratio", "1.5"]])
def test_bad_flags_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--base-url", "http://127.0.0.1:9", *bad])
    assert exc.value.code == 2


def test_a_model_the_server_does_not_list_is_refused_before_any_request(fake_server: FakeServer) -> None:
    """The README's first line once named `--model bench` against `make run`'s `demo`: 0 of 50 succeeded."""
    with pytest.raises(SystemExit) as exc:
        bench(fake_server, "--num-prompts", "2", "--model", "bench")
    assert "'bench' is not served" in str(exc.value.code) and "it serves: fake-model" in str(exc.value.code)
    assert fake_server.bodies == []


@pytest.mark.parametrize("fake_server", [FakeBehaviour(fail_every=2)], indirect=True)
def test_failures_print_their_reason_on_the_terminal(fake_server: FakeServer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    r = bench(fake_server, "--num-prompts", "4", "--random-output-len", "2", "--max-concurrency", "1")
    err = capsys.readouterr().err
    assert r["failed"] == 2 and "2 of 4 requests failed" in err and "2: HTTP 500:" in err and "boom" in err


def test_results_go_under_runs_by_default(fake_server: FakeServer, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bench(fake_server, "--num-prompts", "1", "--random-output-len", "1", "--save-result")
    assert [p.parent for p in tmp_path.rglob("*.json")] == [tmp_path / "runs" / "epd-bench"]


def test_plot_without_matplotlib_is_a_usage_error_naming_the_install(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        run(["--plot", "plots", "--num-prompts", "1"])
    assert exc.value.code == 2 and "pip install -e '.[bench]'" in capsys.readouterr().err
