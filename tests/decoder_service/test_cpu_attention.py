"""The CPU decode attention kernel (decoder_service/engine/cpu_attention.py), the default on the CPU: it reads each
row's own positions of its blocks in place and agrees with the gather + SDPA path it replaces; the engine uses it
unless --cpu-sdpa-attention, a family with masks of its own (Gemma 3) keeps SDPA, and no compiler means the gather
path serves."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decoder_service.cli import parse_args
from decoder_service.engine import cpu_attention
from decoder_service.engine.step_inputs import StepInputs
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import greedy, make_engine, run, text_prompt

BLOCK, DIM = 16, 64


@pytest.fixture(scope="module")
def kernel() -> object:
    module = cpu_attention.load()
    assert module is not None, "the kernel must build wherever `make test` runs (a C++ compiler is on the machine)"
    return module


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              lens: list[int], scale: float) -> torch.Tensor:
    """Each row alone: its first lens[r] positions gathered, SDPA in float32."""
    out = []
    for r, n in enumerate(lens):
        k = k_pool[:, table[r]].flatten(1, 2)[:, :n].float()  # (kv_heads, n, dim)
        v = v_pool[:, table[r]].flatten(1, 2)[:, :n].float()
        out.append(F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k, v, scale=scale, enable_gqa=True)
                   .squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads", "dtype", "tol", "dim", "block"),
                         [(8, 8, torch.float32, 2e-6, DIM, BLOCK), (16, 8, torch.float32, 2e-6, DIM, BLOCK),
                          (14, 2, torch.float32, 2e-6, DIM, BLOCK), (8, 4, torch.bfloat16, 2e-2, DIM, BLOCK),
                          (8, 4, torch.float16, 4e-3, DIM, BLOCK),
                          # the float32 body for dims in 16s at other block sizes and dims; the scalar one at dim 40
                          (8, 2, torch.float32, 2e-6, 128, 8), (4, 4, torch.float32, 2e-6, 32, 48),
                          (6, 3, torch.float32, 2e-6, 40, BLOCK)])
def test_kernel_agrees_with_sdpa_over_each_rows_own_positions(kernel: object, heads: int, kv_heads: int,
                                                              dtype: torch.dtype, tol: float, dim: int,
                                                              block: int) -> None:
    torch.manual_seed(heads + kv_heads + dim + block)
    width, num_blocks = 8, 64
    lens = [1, 2, block - 1, block, block + 1, 77, width * block - 1, width * block]
    rows = len(lens)
    table = torch.stack([torch.randperm(num_blocks - 1)[:width] + 1 for _ in range(rows)])
    for r, n in enumerate(lens):  # unused entries are the null block, as the engine pads
        table[r, -(-n // block):] = 0
    k_pool = torch.randn(kv_heads, num_blocks, block, dim).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks, block, dim).to(dtype)
    k_pool[:, 0], v_pool[:, 0] = float("nan"), float("nan")  # never read: no position past a row's length is
    k_pool[:, table[-1, 3]] *= 3  # larger scores late in a row: the online softmax rescales what came before
    packed = torch.randn(1, heads, rows, dim).to(dtype)  # as the packed forward hands it: (1, heads, tokens, dim)
    q = packed[0].transpose(0, 1)  # (rows, heads, dim), not contiguous
    out = torch.full((rows, heads, dim), float("nan"), dtype=dtype)
    kernel.paged_decode(q, k_pool, v_pool, table, torch.tensor(lens), 0.125, out)  # type: ignore[attr-defined]
    want = reference(q, k_pool, v_pool, table, lens, 0.125)
    assert torch.isfinite(out).all()
    assert (out.float() - want).abs().max().item() < tol


def test_kernel_refuses_what_it_cannot_read(kernel: object) -> None:
    q, pool = torch.randn(2, 8, DIM), torch.randn(4, 8, BLOCK, DIM)
    table, lens = torch.ones(2, 1, dtype=torch.long), torch.tensor([3, 3])
    with pytest.raises(RuntimeError, match="heads or dim"):  # 6 query heads over 4 K/V heads
        kernel.paged_decode(q[:, :6], pool, pool, table, lens, 1.0, torch.empty(2, 6, DIM))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = torch.randn(4, BLOCK, 8, DIM).transpose(1, 2)  # the pool's shape, not its layout
        kernel.paged_decode(q, strided, strided, table, lens, 1.0, torch.empty_like(q))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernel.paged_decode(q.double(), pool.double(), pool.double(), table, lens, 1.0,  # type: ignore[attr-defined]
                            torch.empty_like(q, dtype=torch.double))


def test_the_engine_reads_decode_attention_through_the_kernel_by_default(tiny_model_dirs: dict[str, Path],
                                                                         kernel: object) -> None:
    """The kernel is loaded by default and not with --cpu-sdpa-attention; both give the same greedy answers, with
    log-probabilities equal to float32 rounding, for rows of different lengths decoding together."""
    answers = {}
    for sdpa in (False, True):
        engine = make_engine(tiny_model_dirs["llava"], cpu_sdpa_attention=sdpa, max_model_len=512)
        try:
            assert engine.runner.cache.decode_kernel is (None if sdpa else kernel)
            specs = [(text_prompt(engine, w), greedy(20, logprobs=1)) for w in (1, 4, 9, 30)]
            answers[sdpa] = [(r.text, [t.logprob for e in r.events for t in e.logprobs or []])
                             for r in run(engine, specs)]
        finally:
            engine.close()
    assert [text for text, _ in answers[False]] == [text for text, _ in answers[True]]
    for (_, mine), (_, theirs) in zip(answers[False], answers[True], strict=True):
        assert len(mine) == len(theirs) == 20 and max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < 1e-4


def test_a_family_with_masks_of_its_own_keeps_the_sdpa_path(tiny_model_dirs: dict[str, Path]) -> None:
    assert StepInputs(LanguageHalf(tiny_model_dirs["llava"]), BLOCK).plain_causal
    assert not StepInputs(LanguageHalf(tiny_model_dirs["gemma3"]), BLOCK).plain_causal  # sliding windows, image blocks


def test_without_a_compiler_the_engine_says_so_and_gathers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_attention, "_loaded", {})
    monkeypatch.setenv("EPD_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="epd.decoder"):
        assert cpu_attention.load() is None
    assert "kernel is unavailable" in caplog.text and "/bin/false exited 1" in caplog.text
    assert cpu_attention.load() is None and caplog.text.count("unavailable") == 1  # said once
    assert list(tmp_path.iterdir()) == []  # the failed build left nothing behind


def test_cpu_sdpa_attention_flag() -> None:
    assert parse_args(["--insecure"]).cpu_sdpa_attention is False
    assert parse_args(["--insecure", "--cpu-sdpa-attention"]).cpu_sdpa_attention is True


def test_verification_queries_are_kernel_rows_in_the_decode_group(tiny_model_dirs: dict[str, Path]) -> None:
    """With the kernel, every decode row and every query of a verification (a row each, reading up to its own
    position) are one group: no per-row gather + SDPA for the drafts; the answer is plain greedy's."""
    from decoder_service.engine.spec.config import SpecConfig

    lm = LanguageHalf(tiny_model_dirs["llava"])
    plain = make_engine(tiny_model_dirs["llava"], lm, max_model_len=512)
    spec = make_engine(tiny_model_dirs["llava"], lm, max_model_len=512,
                       speculative_config=SpecConfig(num_speculative_tokens=4, disable_by_batch_size=64))
    try:
        specs = [(text_prompt(plain, w), greedy(48)) for w in (2, 5)]
        want = [r.text for r in run(plain, specs)]
        inputs, seen = spec.runner.inputs, []
        assert inputs.in_place
        real_plan = inputs.plan

        def plan(segments, tokens):  # type: ignore[no-untyped-def]
            out = real_plan(segments, tokens)
            seen.append(([(s.decode, s.num, bool(s.feed)) for s in segments], out[0].groups))
            return out

        inputs.plan = plan  # type: ignore[method-assign]
        assert [r.text for r in run(spec, specs)] == want
    finally:
        plain.close()
        spec.close()
    verifying = [(segs, groups) for segs, groups in seen if any(feed for _, _, feed in segs)]
    assert verifying, "the n-gram proposer proposed nothing"
    for segs, groups in verifying:
        rows = sum(num for decode, num, feed in segs if decode or feed)
        assert groups[0].decode and groups[0].num_q == rows and groups[0].lens_tensor is not None
        assert len(groups) == 1 + sum(not decode and not feed for decode, _, feed in segs)  # + prefill chunks
