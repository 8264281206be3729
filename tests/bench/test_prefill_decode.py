"""The prefill/decode benchmark: which gaps it counts, how it pins the two stacks, and one run end to end on the demo
model (one round, two short streams, one long prompt), where E + P + D hands the long prompt off (its decode worker
resumes it from the prefill worker's K/V) and declines the short ones while E + PD hands off none, and every request
answers. No timing is asserted: the ratios' target is the benchmark's to report, not a test's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_bench.backends import RequestOutput
from epd_bench.prefill_decode import build_systems, core_halves, in_window, main

MIN_TOKENS = 64  # the demo's short prompts are under it, its 60-word long prompt over it


def answered(ttft: float, itl: list[float]) -> RequestOutput:
    return RequestOutput(success=True, ttft=ttft, itl=itl, latency=ttft + sum(itl))


def test_only_gaps_ending_while_long_prompts_are_in_flight_count() -> None:
    longs = [(10.0, answered(1.0, [0.5])), (11.0, answered(2.0, [1.0]))]  # in flight from 10 s to 14 s
    shorts = [(9.0, answered(0.5, [0.25, 0.25, 0.25, 0.25])),  # chunks at 9.5, 9.75, 10, 10.25, 10.5
              (13.0, answered(0.5, [0.5, 1.0])),  # chunks at 13.5, 14, 15: its TTFT counts, its last gap not
              (12.0, RequestOutput(error="HTTP 503"))]
    got = in_window(shorts, longs)
    assert got["itl_s"] == [0.25, 0.25, 0.25, 0.5]  # gaps ending at 10, 10.25, 10.5 and 14
    assert got["itl_running_s"] == [0.25, 0.25, 0.25]  # without each request's first gap (its hand-off in e+p+d)
    assert got["short_ttft_s"] == [0.5]
    assert got["short_chunks_per_s"] == 5 / 4.0


def test_the_decode_side_has_its_cores_and_the_prefill_worker_shares_the_rest_with_encoder_and_proxy() -> None:
    decode, other = core_halves()
    together, apart = build_systems(Path("/model"), pin=True)
    assert [(p.name, p.cpus) for p in together.procs] == [("encoder", other), ("decoder", decode), ("proxy", other)]
    assert [(p.name, p.cpus) for p in apart.procs] == [("encoder", other), ("prefill", other), ("decoder", decode),
                                                       ("proxy", other)]
    assert all(p.threads == len(p.cpus or ()) and "--insecure" in p.argv for p in (*together.procs, *apart.procs))
    roles = {s.name: [p.argv[p.argv.index("--role") + 1] for p in s.procs if "--role" in p.argv]
             for s in (together, apart)}
    assert roles == {"e+pd": ["both"], "e+p+d": ["prefill", "decode"]}
    assert apart.procs[-1].argv[-2:] == ("--prefill-servers-urls", apart.procs[1].url)
    assert "--prefill-servers-urls" not in together.procs[-1].argv
    assert together.decoder_url == together.procs[1].url and apart.decoder_url == apart.procs[2].url
    assert "--handoff-min-tokens" not in apart.procs[1].argv  # the prefill worker's default
    _, apart = build_systems(Path("/model"), pin=True, handoff_min_tokens=0)
    assert apart.procs[1].argv[-2:] == ("--handoff-min-tokens", "0")


@pytest.mark.e2e  # starts two stacks: two encoders, three decoders, two proxies
def test_e_p_d_hands_the_long_prompt_off_to_the_decode_worker_and_e_pd_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "demo", "--rounds", "1", "--streams", "2", "--long-prompts", "1", "--long-words", "60",
          "--short-tokens", "8", "--long-tokens", "3", "--lead-s", "0.2", "--handoff-min-tokens", str(MIN_TOKENS),
          "--out-dir", str(tmp_path), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert json.loads((Path(s["run_dir"]) / "summary.json").read_text()) == s
    apart, together = s["systems"]["e+p+d"], s["systems"]["e+pd"]
    for x in (apart, together):
        assert x["failed"] == 0 and x["errors"] == [] and x["requests"] >= 3  # the long one and a short one a stream
        # the first-to-second gap is 0 when both tokens arrive in one read of the stream (seen on a busy machine)
        assert x["long_prompt_tokens"] > 100 and x["long_ttft_ms"] > 0 and x["long_first_to_second_ms"] >= 0
        assert x["itl_ms"]["n"] >= x["itl_running_ms"]["n"]
    # the long e+p+d request prefilled on the prefill worker and resumed from its K/V; the short ones, under
    # --handoff-min-tokens, declined there and prefilled on the decoder
    assert apart["long_prompt_tokens"] >= MIN_TOKENS
    assert apart["proxy_handoffs"] == apart["decoder_resumed_kv"] == 1 and apart["decoder_recomputed"] == 0
    assert apart["proxy_declined"] == apart["requests"] - 1
    assert together["proxy_handoffs"] == together["decoder_resumed_kv"] == together["decoder_recomputed"] == 0
    assert together["proxy_declined"] == 0
    assert s["warm_up"]["e+p+d"]["decoder"]["resumed_kv"] >= 1 and s["warm_up"]["e+pd"]["proxy"]["handoffs"] == 0
    # the transfer, measured at the long prompt's K/V size
    kv = s["transfer"]
    assert kv["num_tokens"] == apart["long_prompt_tokens"]
    assert kv["bytes"] == kv["blocks"] * kv["layout"]["block_size"] * s["bytes_per_token"]
    assert kv["blocks"] == -(-kv["num_tokens"] // kv["layout"]["block_size"])
    assert kv["kv_fetch_mb_s"] > 0 and kv["raw_zmq_mb_s"] > 0 and kv["ratio"] > 0
    assert s["transfer_added_ms"] is not None and isinstance(s["met"], bool) and s["target"] == 0.5
    if s["pinning"]["pinned"]:
        decode, other = s["pinning"]["decode_side"], s["pinning"]["prefill_encoder_proxy"]
        assert {p["name"]: p["cpus"] for p in s["processes"]["e+p+d"]} == {
            "encoder": other, "prefill": other, "decoder": decode, "proxy": other}
