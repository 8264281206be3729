"""epd_builders/tp_plans.py: a rank's bytes against the one-device count of quant_plans.py (what is split shrinks by
N, what is replicated does not), the K/V share per rank, and each refusal naming its tensor and numbers."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from epd_builders.quant_plans import held_bytes
from epd_builders.tp_plans import TP_MODELS, main, plans, rank_held

BF16_72B, AWQ_72B, FP8_235B = TP_MODELS


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int, int], dict[str, Any]]:
    return {(r["model"], r["tp"], r["device_gib"]): r for r in plans()}


@pytest.mark.parametrize("model", [AWQ_72B, FP8_235B], ids=["awq", "fp8"])
def test_one_rank_holds_what_the_one_device_count_holds(model: Any) -> None:
    assert rank_held(model, 1).weight_bytes == held_bytes(model).weight_bytes
    assert rank_held(model, 1).refusals == ()


def test_what_is_split_halves_and_what_is_replicated_stays() -> None:
    one, two, four = (rank_held(BF16_72B, n).weight_bytes for n in (1, 2, 4))
    assert one == held_bytes(AWQ_72B).decoder_params * 2  # bf16: every decoder parameter at two bytes
    assert one - two == 2 * (two - four)  # the split part halves at each doubling
    text = AWQ_72B.text
    replicated = 2 * two - one  # embeddings, lm_head, norms
    assert replicated == pytest.approx(2 * text["vocab_size"] * text["hidden_size"] * 2, rel=0.001)


def test_each_rank_holds_its_share_of_the_k_v_heads(rows: dict[tuple[str, int, int], dict[str, Any]]) -> None:
    per_token = 80 * 2 * 8 * 128 * 2  # 72B: layers x K and V x 8 K/V heads x head_dim x bf16
    for tp in (2, 4, 8):
        assert rows[(BF16_72B.name, tp, 141)]["rank_bytes_per_token"] == per_token // tp
    # half the weights per rank and half the K/V per token: TP 4 on 80 GiB holds more blocks than TP 2 on 141
    assert rows[(BF16_72B.name, 4, 80)]["num_blocks"] > rows[(BF16_72B.name, 2, 141)]["num_blocks"]
    assert rows[(BF16_72B.name, 2, 80)]["max_model_len"] < 128000 == rows[(BF16_72B.name, 2, 141)]["max_model_len"]


def test_refusals_name_the_tensor_and_the_numbers(rows: dict[tuple[str, int, int], dict[str, Any]]) -> None:
    tp8 = rows[(FP8_235B.name, 8, 141)]["refused"]
    assert "4 K/V heads are not divisible by 8" in tp8
    assert "self_attn.k_proj: out 512 / 8 = 64 cuts an FP8 block of 128" in tp8
    assert "experts.gate_up_proj: out 1536 / 8 = 192 cuts an FP8 block of 128" in tp8
    assert "exceed 0.9 x 80 GiB" in rows[(FP8_235B.name, 2, 80)]["refused"]
    assert rows[(FP8_235B.name, 4, 80)]["refused"] is None
    assert "down_proj: in 29568 / 2 = 14784 cuts an int4 group of 128" in rows[(AWQ_72B.name, 2, 80)]["refused"]


def test_an_int4_mlp_padded_to_whole_groups_splits_eight_ways() -> None:
    padded = replace(AWQ_72B, text={**AWQ_72B.text, "intermediate_size": 29696})  # 232 groups of 128
    assert all(rank_held(padded, n).refusals == () for n in (2, 4, 8))


def test_the_cli_prints_one_row_per_model_tp_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--devices-gib", "80", "--tp", "4"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(TP_MODELS) and all("| 4 | 80 |" in line for line in lines[2:])
