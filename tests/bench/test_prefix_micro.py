"""The issue 16 micro-benchmarks: copy vs share of a cached prefix (epd_bench.prefix_share), and publishing held
prefixes by /health summary vs events (epd_bench.prefix_publish); tiny sizes, through their main(argv)."""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from decoder_service.engine.slots import SlotCache
from epd_bench import prefix_publish, prefix_share
from epd_bench.prefix_share import BLOCK, SHAPES, copy_per_block, copy_stack, make_blocks, share_cat


def _run(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    main(argv)
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_every_copy_puts_the_blocks_in_the_slot_row_and_share_cat_puts_them_in_front() -> None:
    shape = SHAPES["bench"]
    cache = SlotCache(shape.config(64), max_slots=2, max_len=64, dtype=torch.float32)
    blocks = make_blocks(shape, 3 * BLOCK, torch.float32)
    want_k = [torch.cat([b[i, 0] for b in blocks], dim=1) for i in range(shape.layers)]  # (kv, P, hd) per layer
    want_v = [torch.cat([b[i, 1] for b in blocks], dim=1) for i in range(shape.layers)]
    scratch = torch.zeros(4, shape.layers, 2, shape.kv_heads, BLOCK, shape.head_dim)
    for copy in (lambda: copy_stack(cache, 1, blocks), lambda: copy_stack(cache, 1, blocks, scratch),
                 lambda: copy_per_block(cache, 1, blocks)):
        for layer in cache.slot_layers:
            assert layer.keys is not None and layer.values is not None
            layer.keys.zero_(), layer.values.zero_()
        copy()
        for i, layer in enumerate(cache.slot_layers):
            assert layer.keys is not None and layer.values is not None
            assert torch.equal(layer.keys[1, :, : 3 * BLOCK], want_k[i])
            assert torch.equal(layer.values[1, :, : 3 * BLOCK], want_v[i])
            assert not layer.keys[0].any() and not layer.keys[1, :, 3 * BLOCK :].any()  # nothing else written
    out = torch.empty(2, shape.kv_heads, 3 * BLOCK + 5, shape.head_dim)
    share_cat(cache, 1, blocks, 5, out)  # the last layer's prefix + the row's first 5 columns
    assert torch.equal(out[0, :, : 3 * BLOCK], want_k[-1]) and torch.equal(out[1, :, : 3 * BLOCK], want_v[-1])


def test_prefix_share_reports_copy_share_and_prefill_per_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    out = _run(prefix_share.main, ["--json", "--shapes", "bench", "--prefix", "16", "64", "--decode", "1", "8",
                                   "--prefill-max", "16", "--budget", "0"], capsys)
    assert torch.get_num_threads() == threads  # --threads applies to the run only
    shape = out["shapes"]["bench"]
    per_token = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 kv heads, head_dim 64, fp32
    assert shape["kv_bytes_per_token"] == per_token and shape["memory"]["slot_row_bytes_at_max_len"] == 72 * per_token
    rows = shape["rows"]
    assert [r["prefix_tokens"] for r in rows] == [16, 64]
    assert [r["prefix_kv_bytes"] for r in rows] == [16 * per_token, 64 * per_token]
    for r in rows:
        assert min(r["copy_stack_ms"], r["copy_stack_scratch_ms"], r["copy_per_block_ms"]) > 0
        for name in ("share_cat", "share_cat_into_buffer"):
            share = r[name]
            assert share["per_step_ms"] > 0 and share["break_even_steps"] > 0
            assert 0 < share["over_decode_ms"]["1"] < share["over_decode_ms"]["8"]  # grows with D
    assert rows[0]["prefill_ms"] > 0 and rows[0]["prefill_over_best_copy"] > 0
    assert rows[1]["prefill_ms"] is None  # over --prefill-max
    assert "cases" in out["conclusion"] and "bench P=64" in out["conclusion"]


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
