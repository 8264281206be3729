"""epd_builders/quant_plans.py: the counts built on meta against the hub's published numbers, and the plans' shape
(refused where the weights cannot fit, K/V from what is left) against an estimate written here from those numbers."""
from __future__ import annotations

from typing import Any

import pytest

from epd_builders.quant_plans import BLOCK_SIZE, DEVICES_GIB, GIB, MODELS, UTILIZATION, main, plans

# What the hub shows as "Model size" for each bf16 original (safetensors parameters, LM + vision), and the vision
# towers: Qwen2.5-VL's ViT is 675M in its technical report; Qwen3-VL's is SigLIP-2 So400m with its mergers
# (about 0.5B; an error of 0.1B is 0.3 % of the smallest of these models). vocab x hidden from the hub configs.
PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-VL-30B-A3B-Instruct-FP8": dict(params=31.1e9, vision=0.5e9, vocab=151936, hidden=2048, bits=8,
                                               layers=48, kv_heads=4),
    "Qwen/Qwen2.5-VL-7B-Instruct-AWQ": dict(params=8.29e9, vision=0.675e9, vocab=152064, hidden=3584, bits=4,
                                            layers=28, kv_heads=4),
    "Qwen/Qwen2.5-VL-72B-Instruct-AWQ": dict(params=73.4e9, vision=0.675e9, vocab=152064, hidden=8192, bits=4,
                                             layers=80, kv_heads=8),
    "Qwen/Qwen3-VL-235B-A22B-Instruct-FP8": dict(params=236e9, vision=0.5e9, vocab=151936, hidden=4096, bits=8,
                                                 layers=94, kv_heads=4),
}
HEAD_DIM = 128  # all four


def estimate_bytes(pub: dict[str, Any]) -> float:
    """Embeddings and lm_head (untied) in bf16; every other LM parameter at its bits, plus int4's bf16 scale and
    zero per 128 weights (norms, biases and routers are under 0.1 %: counted quantized here)."""
    table = 2 * pub["vocab"] * pub["hidden"]
    per_weight = 1.0 if pub["bits"] == 8 else 0.5 + 4 / 128
    return table * 2 + (pub["params"] - pub["vision"] - table) * per_weight


@pytest.fixture(scope="module")
def result() -> dict[str, dict[str, Any]]:
    return {m["model"]: m for m in plans()}


def test_every_model_is_planned_on_every_device(result: dict[str, dict[str, Any]]) -> None:
    assert list(result) == [m.name for m in MODELS] == list(PUBLISHED)
    assert all([r["device_gib"] for r in m["rows"]] == list(DEVICES_GIB) for m in result.values())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameters_counted_on_meta_match_the_published_totals(result: dict[str, dict[str, Any]], name: str) -> None:
    m, pub = result[name], PUBLISHED[name]
    assert m["total_params"] == pytest.approx(pub["params"], rel=0.01)
    assert m["vision_params"] == pytest.approx(pub["vision"], rel=0.2)  # on the encoder, not the decoder
    assert m["decoder_params"] + m["vision_params"] == m["total_params"]
    # all but the embeddings and lm_head are the quantized projections (and FP8 experts); norms, biases, routers
    assert m["quantized_params"] + 2 * pub["vocab"] * pub["hidden"] == pytest.approx(m["decoder_params"], rel=0.005)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_weight_bytes_within_two_percent_of_the_published_estimate(result: dict[str, dict[str, Any]],
                                                                   name: str) -> None:
    m = result[name]
    assert m["weight_bytes"] == pytest.approx(estimate_bytes(PUBLISHED[name]), rel=0.02)
    assert m["weight_bytes"] == m["quantized_bytes"] + m["bf16_bytes"]
    bits = PUBLISHED[name]["bits"]
    assert m["quantized_bytes"] < m["quantized_params"] * (bits / 8) * 1.07  # held quantized, not bf16


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_refused_exactly_where_the_weights_leave_no_room_and_k_v_takes_the_rest(
        result: dict[str, dict[str, Any]], name: str) -> None:
    pub = PUBLISHED[name]
    per_token = pub["layers"] * 2 * pub["kv_heads"] * HEAD_DIM * 2  # bf16 K and V
    for row in result[name]["rows"]:
        budget = int(row["device_gib"] * GIB * UTILIZATION)
        if estimate_bytes(pub) > budget * 1.02:  # the estimate says no room: refused, with the numbers
            assert row["refused"] and "needs tensor parallelism" in row["refused"]
            assert f"{row['weight_bytes'] / GIB:.1f} GiB" in row["refused"] and "KVPlanError" in row["refused"]
            assert "num_blocks" not in row
        elif estimate_bytes(pub) < budget * 0.98 - 1024 * per_token:
            assert row["refused"] is None and row["bytes_per_token"] == per_token
            pool = budget - row["weight_bytes"]
            assert row["pool_bytes"] == pool and (row["num_blocks"] + 1) * BLOCK_SIZE * per_token > pool
            assert row["num_blocks"] * BLOCK_SIZE * per_token <= pool
            assert row["max_model_len"] == min(row["checkpoint_max_len"], (row["num_blocks"] - 1) * BLOCK_SIZE)


def test_the_235b_moe_is_refused_on_one_device_of_every_size(result: dict[str, dict[str, Any]]) -> None:
    rows = result["Qwen/Qwen3-VL-235B-A22B-Instruct-FP8"]["rows"]
    assert all(r["refused"] and "needs tensor parallelism" in r["refused"] for r in rows)


def test_the_cli_prints_one_markdown_row_per_model_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--devices-gib", "80"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| model |") and len(lines) == 2 + len(MODELS)
    assert all(f"| {m.name} |" in line for m, line in zip(MODELS, lines[2:], strict=True))
    assert "**refused**" in lines[-1] and "needs tensor parallelism" in lines[-1]
