"""oneDNN's prepacked linears, the CPU default (--cpu-exact-linear: F.linear): every input through the packed weight,
the plain weight not kept; at these small shapes a row's result does not depend on the rows beside it, so batched and
solo outputs stay equal (at real shapes oneDNN's kernel choice by rows can move the last bits: cpu_linear.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from decoder_service.cli import parse_args
from decoder_service.engine import cpu_linear
from decoder_service.engine.cpu_linear import PackedLinear, pack_linears
from epd_models.halves import loaded_summary
from tests.decoder_service.engine_run import greedy, make_engine, run, text_prompt

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN")


def test_packed_linear_agrees_with_f_linear_at_decode_and_prefill_sizes_and_rows_are_independent() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear)
    x, big = torch.randn(1, 8, 64), torch.randn(1, 300, 64)
    with torch.inference_mode():
        got = packed(x)
        alone = torch.cat([packed(x[:, i : i + 1]) for i in range(8)], dim=1)
        assert torch.allclose(packed(big), linear(big), rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, linear(x), rtol=1e-5, atol=1e-5) and torch.equal(got, alone)


def test_pack_linears_replaces_every_linear_and_drops_the_plain_weight() -> None:
    module = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU()))
    assert pack_linears(module) == 2
    assert isinstance(module[0], PackedLinear) and isinstance(module[1][0], PackedLinear)
    assert module[1][0].out_features == 4 and module[1][0].bias is None
    # what is left as parameters is the first linear's bias: the weights live only in the packed tensors
    assert [tuple(p.shape) for p in module.parameters()] == [(8,)]


def test_health_counts_a_packed_linears_weights_as_held() -> None:
    """/health's `loaded` (loaded_summary) counts the prepacked weights: the plain ones are gone, not the parameters."""
    module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4, bias=False))
    before = loaded_summary(module)
    pack_linears(module)
    assert loaded_summary(module) == before == {"modules": ["0", "1"], "num_parameters": 8 * 16 + 16 + 16 * 4}


def test_the_engine_packs_its_linears_by_default_and_not_with_cpu_exact_linear(tiny_model_dirs: dict[str, Path]) -> None:
    for exact, kind in ((False, PackedLinear), (True, nn.Linear)):
        engine = make_engine(tiny_model_dirs["llava"], cpu_exact_linear=exact)
        try:
            assert type(engine.lm.module.lm_head) is kind
        finally:
            engine.close()


def test_cpu_exact_linear_flag_and_the_old_cpu_packed_linear_flag_still_accepted() -> None:
    assert parse_args(["--insecure"]).cpu_exact_linear is False
    assert parse_args(["--insecure", "--cpu-exact-linear"]).cpu_exact_linear is True
    assert parse_args(["--insecure", "--cpu-packed-linear"]).cpu_exact_linear is False  # the default now: a no-op


def test_an_engine_with_packed_linears_gives_each_request_its_solo_output(tiny_model_dirs: dict[str, Path]) -> None:
    engine = make_engine(tiny_model_dirs["llava"])
    try:
        assert isinstance(engine.lm.module.lm_head, PackedLinear)
        specs = [(text_prompt(engine, w), greedy(16)) for w in (2, 5, 9, 14)]
        solo = [run(engine, [s])[0].answer() for s in specs]
        assert [r.answer() for r in run(engine, specs)] == solo
    finally:
        engine.close()


def _resident_kib(path: Path) -> int:
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            inside = head[-1] == str(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_drop_clean_pages_gives_back_a_read_checkpoint_s_pages_and_its_tensors_read_the_same(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, str(path))
    with path.open("rb") as written:  # a page not yet written back counts as dirty: such a mapping is left alone
        os.fsync(written.fileno())
    with safe_open(str(path), "pt") as f:
        w = f.get_tensor("w")  # memory-mapped, as epd_models/weights.py loads
    want = float(w.sum())  # reads every page
    assert _resident_kib(path) >= 4096
    assert cpu_linear.drop_clean_pages() >= 4 << 20 and _resident_kib(path) == 0
    assert float(w.sum()) == want
