"""epd_bench.family_bytes: connector bytes per 1024x768 image, counted by each family's own processor."""
from __future__ import annotations

import json

import pytest

from epd_bench.family_bytes import REAL, FamilyBytes, family_bytes, main, markdown
from epd_builders.tiny import FAMILIES


def test_every_family_has_a_real_size_checkpoint() -> None:
    assert set(REAL) == set(FAMILIES)


def test_llava_1_5_ships_576_rows_of_4096_in_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--json", "--family", "llava"])
    tiny, real = json.loads(capsys.readouterr().out)
    assert (real["checkpoint"], real["image_tokens"], real["hidden_size"], real["bytes"]) == (
        "llava-hf/llava-1.5-7b-hf", 576, 4096, 576 * 4096 * 2)
    assert (tiny["image_tokens"], tiny["hidden_size"], tiny["bytes"]) == (256, 64, 256 * 64 * 4)  # (224 / 14)^2


def test_qwen3_vl_ships_its_deepstack_sets_too() -> None:
    """1024x768 at 32 px per token (patch 16, merge 2) is 32 x 24 = 768 tokens; DeepStack layers 8, 16, 24 add
    three more sets of rows."""
    tiny, real = family_bytes("qwen3_vl")
    assert (real.image_tokens, real.hidden_size, real.deepstack_layers) == (768, 4096, 3)
    assert real.num_bytes == 768 * 4096 * 2 * 4
    assert tiny.deepstack_layers == 2 and tiny.num_bytes == tiny.image_tokens * 64 * 4 * 3


def test_the_token_count_follows_the_image_size() -> None:
    """Qwen2-VL rounds each side to 28 px: 1024x768 -> 1036x756 -> 37 x 27 = 999 tokens (a fixed-size family
    would give the same count for any image)."""
    _, real = family_bytes("qwen2_vl")
    assert (real.image_tokens, real.hidden_size) == (999, 3584)


def test_the_table_shows_deepstack_and_both_sizes() -> None:
    rows = [FamilyBytes("qwen3_vl", "tiny", "tiny", 6, 64, 2, 4), FamilyBytes("qwen3_vl", "real", "Q", 768, 4096, 3, 2)]
    line = markdown(rows).splitlines()[-1]
    assert line == ("| qwen3_vl | 6 x 64 x (1 + 2 DeepStack) x 4 B = 4,608 B | Q | 768 x 4096 x (1 + 3 DeepStack) x 2 B "
                    "| 25,165,824 B (24.00 MiB) |")
