"""--cpu-packed-linear: oneDNN's prepacked matmul for decode-sized inputs, F.linear for larger ones; a row's result
does not depend on the rows beside it, so batched and solo outputs stay equal."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from decoder_service.engine import cpu_linear
from decoder_service.engine.cpu_linear import PACKED_MAX_ROWS, PackedLinear, pack_linears
from tests.decoder_service.engine_run import greedy, make_engine, run, text_prompt

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN")


def test_small_inputs_take_the_packed_path_and_agree_with_f_linear_and_rows_are_independent() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear)
    x = torch.randn(1, 8, 64)
    with torch.inference_mode():
        got = packed(x)
        alone = torch.cat([packed(x[:, i : i + 1]) for i in range(8)], dim=1)
        big = packed(torch.randn(1, PACKED_MAX_ROWS + 1, 64))
    assert torch.allclose(got, linear(x), rtol=1e-5, atol=1e-5) and torch.equal(got, alone)
    assert big.shape == (1, PACKED_MAX_ROWS + 1, 96)


def test_pack_linears_wraps_every_linear_and_keeps_the_weights() -> None:
    module = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()))
    assert pack_linears(module) == 2
    assert isinstance(module[0], PackedLinear) and isinstance(module[1][0], PackedLinear)
    assert module[1][0].weight.shape == (4, 8) and module[1][0].out_features == 4


def test_an_engine_with_packed_linears_gives_each_request_its_solo_output(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["llava"], cpu_packed_linear=True)
    try:
        assert isinstance(engine.lm.module.lm_head, PackedLinear)
        specs = [(text_prompt(engine, w), greedy(16)) for w in (2, 5, 9, 14)]
        solo = [run(engine, [s])[0].answer() for s in specs]
        assert [r.answer() for r in run(engine, specs)] == solo
    finally:
        engine.close()
