"""Tensor parallelism on the CPU (gloo): a decoder at --tensor-parallel-size 2 (this process is rank 0, one rank
process beside it) gives the tokens of size 1, greedy and seeded, for dense, MoE and quantized checkpoints; its
logprobs differ by all-reduce order only (LOGPROB_TOL); prefix reuse, n > 1, preemption and hand-offs between
workers of different sizes hold."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.tp.load import load_language
from decoder_service.engine.tp.ranks import Ranks, RankStartError
from decoder_service.engine.work import Work
from decoder_service.handoff import resume_from
from decoder_service.preflight import check_kv_fits
from decoder_service.shell import Engine
from epd_common.startup import ConfigError
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf
from epd_models.quant.forms import Fp8Weight, Int4Weight
from epd_models.tensor_parallel import Split, SplitError
from tests.decoder_service.engine_run import Result, make_engine, run
from tests.decoder_service.test_handoff import MemoryStore, chain_of, handoff_engine, run_one
from tests.decoder_service.test_preemption import prompts
from tests.quant_models import QuantModels

MAX_TOKENS = 24
# |logprob(TP 2) - logprob(TP 1)| of every chosen token and top alternative: the two ranks' partial sums are added by
# the all-reduce in another order than one matmul adds them (float32 on the CPU); measured up to ~2e-6 on the tiny
# models, bounded here with room
LOGPROB_TOL = 1e-4
KEPT_TOL = 0.05  # kept-quantized linears: |logit(TP 2) - logit(TP 1)| / max |logit|; measured below 1e-2
SPECS = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2),
         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)]


@contextmanager
def tp_half(model_dir: Path, size: int = 2, quantized: str = "auto") -> Iterator[LanguageHalf]:
    lm = load_language(model_dir, dtype="auto", device="cpu", quantized=quantized, size=size)
    try:
        yield lm
    finally:
        if lm.ranks is not None:
            lm.ranks.close()


def answers(model_dir: Path, lm: LanguageHalf, **cfg: object) -> list[Result]:
    engine = make_engine(model_dir, lm, **{"max_model_len": 2048, **cfg})
    try:
        ps = prompts(model_dir, lm)
        return run(engine, [(p, s) for p in (ps[0], ps[-1]) for s in SPECS])  # text, then image and text
    finally:
        engine.close()


def assert_same(tp2: list[Result], tp1: list[Result]) -> float:
    """Texts, finish reasons and token counts equal; chosen tokens and alternatives equal with logprobs within
    LOGPROB_TOL. Returns the largest logprob difference."""
    assert [r.answer() for r in tp2] == [r.answer() for r in tp1]
    worst = 0.0
    for a, b in zip(tp2, tp1, strict=True):
        la = [lp for e in a.events for lp in e.logprobs or []]
        lb = [lp for e in b.events for lp in e.logprobs or []]
        assert [x.token for x in la] == [x.token for x in lb] and la
        for x, y in zip(la, lb, strict=True):
            assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
            diffs = [abs(x.logprob - y.logprob)] + [abs(s.logprob - t.logprob)
                                                     for s, t in zip(x.top_logprobs, y.top_logprobs, strict=True)]
            worst = max(worst, *diffs)
    assert worst <= LOGPROB_TOL
    print(f"largest logprob difference TP 2 vs TP 1: {worst:.2e}")
    return worst


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "qwen3_vl_moe", "llava"])
def test_tp2_gives_the_tokens_of_tp1(tiny_model_dirs: dict[str, Path], family: str) -> None:
    model_dir = tiny_model_dirs[family]
    tp1 = answers(model_dir, LanguageHalf(model_dir))
    with tp_half(model_dir) as lm:
        assert lm.kv_heads * 2 == LanguageHalf(model_dir).kv_heads
        tp2 = answers(model_dir, lm)
    assert_same(tp2, tp1)


@pytest.mark.parametrize(("family", "fmt"), [("qwen2_5_vl", "awq"), ("qwen3_vl_moe", "fp8")])
def test_tp2_of_a_quantized_checkpoint(quant_model_dirs: QuantModels, family: str, fmt: str) -> None:
    """Dequantized at load (the CPU default), split as any checkpoint."""
    checkpoint, _ = quant_model_dirs[(family, fmt)]
    tp1 = answers(checkpoint, LanguageHalf(checkpoint))
    with tp_half(checkpoint) as lm:
        assert lm.quant.summary() is not None
        tp2 = answers(checkpoint, lm)
    assert_same(tp2, tp1)


def last_logits(model_dir: Path, lm: LanguageHalf) -> torch.Tensor:
    """The last-position logits of the preemption tests' image prompt, prefilled alone."""
    runner = ModelRunner(lm, 1, 1024, prefix_block=16)
    runner.add("row", prompts(model_dir, lm)[-1])
    return runner.prefill(1 << 30)["row"]


@pytest.mark.parametrize(("family", "fmt"), [("qwen2_5_vl", "awq"), ("qwen3_vl", "fp8")])
def test_tp2_keeps_a_quantized_checkpoint_quantized(quant_model_dirs: QuantModels, family: str, fmt: str) -> None:
    """--quantized-weights keep: each rank holds its share of the published values and of their block scales, or
    group scales and zeros (the experts' too), and runs the quantized kernels on it. The kernels' own arithmetic
    (int4 tinygemm on bf16 activations) rounds differently when a matmul is cut in two, so the logits are compared
    within KEPT_TOL of their scale, not token for token."""
    checkpoint, _ = quant_model_dirs[(family, fmt)]
    one = LanguageHalf(checkpoint, quantized="keep")
    want = last_logits(checkpoint, one)
    with tp_half(checkpoint, quantized="keep") as lm:
        assert lm.quant.kept == one.quant.kept > 0 and lm.quant.dequantized == one.quant.dequantized
        got = last_logits(checkpoint, lm)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{family} {fmt} kept: largest logit difference TP 2 vs TP 1 = {err:.2e} of the largest logit")
    assert err <= KEPT_TOL


def test_kept_fp8_experts_whose_width_would_cut_a_block_are_refused(quant_model_dirs: QuantModels) -> None:
    """The tiny MoE's experts are 96 wide in FP8 blocks of 32: 48 per rank would cut one (as Qwen3-VL-235B-A22B-FP8's
    1,536 at TP 8 would cut its blocks of 128). Kept: refused with the numbers; dequantized: split like any weight."""
    checkpoint, _ = quant_model_dirs[("qwen3_vl_moe", "fp8")]
    with pytest.raises(SplitError, match=r"experts\.0\.down_proj: in 96 / 2 = 48 cuts an FP8 block of 32"):
        LanguageHalf(checkpoint, quantized="keep", tp_rank=1, tp_size=2)
    assert LanguageHalf(checkpoint, quantized="dequantize", tp_rank=1, tp_size=2).quant.dequantized > 0


def test_a_quantized_form_cuts_as_its_dequantized_weight_and_refuses_a_cut_inside_a_block() -> None:
    gen = torch.Generator().manual_seed(0)
    int4 = Int4Weight(torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=gen), torch.rand(64, 4) + 0.1,
                      torch.randint(0, 16, (64, 4)).float(), torch.arange(128) // 32, 32)
    fp8 = Fp8Weight(torch.randn(256, 128, generator=gen).to(torch.float8_e4m3fn), torch.rand(2, 1) + 0.1, (128, 128))
    for prefix in ("language_model.layers.0.self_attn.k_proj", "language_model.layers.0.mlp.down_proj"):
        dim = 0 if "k_proj" in prefix else 1
        for form in (int4, fp8):
            for rank in (0, 1):
                want = form.dequantize(torch.float32).chunk(2, dim=dim)[rank]
                assert torch.equal(Split(rank, 2).form(prefix, form).dequantize(torch.float32), want)
    with pytest.raises(SplitError, match=r"down_proj: in 128 / 8 = 16 cuts an int4 group of 32"):
        Split(0, 8).form("language_model.layers.0.mlp.down_proj", int4)
    with pytest.raises(SplitError, match=r"k_proj: out 256 / 4 = 64 cuts an FP8 block of 128"):
        Split(0, 4).form("language_model.layers.0.self_attn.k_proj", fp8)


def test_prefix_reuse_and_n_choices_at_tp2(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["qwen2_5_vl"]
    n3 = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, n=3, ignore_eos=True)

    def twice(lm: LanguageHalf) -> tuple[list[dict[int, str]], int]:
        engine = make_engine(model_dir, lm, prefix_cache_bytes=1 << 20, block_size=16, max_model_len=2048)
        try:
            image = prompts(model_dir, lm)[-1]
            first = run_one(engine, Work(image, n3, chain=chain_of(engine, image)), 3)
            prefilled = engine.runner.num_prefilled_tokens
            again = run_one(engine, Work(image, n3, chain=chain_of(engine, image)), 3)  # from the prefix cache
            return [first.texts, again.texts], engine.runner.num_prefilled_tokens - prefilled
        finally:
            engine.close()

    tp1, again1 = twice(LanguageHalf(model_dir))
    with tp_half(model_dir) as lm:
        tp2, again2 = twice(lm)
    assert again2 == again1 and 0 < again2 <= 16  # the second time only the last, partial block is prefilled
    assert tp2 == tp1 and tp2[0] == tp2[1] and len(set(tp2[0].values())) == 3


def test_preemption_at_tp2(tiny_model_dirs: dict[str, Path]) -> None:
    """A pool (per rank) that holds one sequence: preempted sequences finish with their solo output."""
    model_dir = tiny_model_dirs["gemma3"]
    with tp_half(model_dir) as lm:
        ps = prompts(model_dir, lm)
        block, tokens = 16, 64
        max_len = -(-(max(p.num_tokens for p in ps) + tokens + 1) // block) * block
        per_block = KVShape.of(lm.config.get_text_config(), lm.dtype, lm.tp_size).bytes_per_block(block)
        engine = make_engine(model_dir, lm, max_model_len=max_len, block_size=block, prefix_cache_bytes=0,
                             kv_cache_memory=(max_len // block + 2) * per_block)
        specs = [(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)) for p in ps]
        try:
            solo = [run(engine, [s])[0] for s in specs]
            together = run(engine, specs)
            assert engine.scheduler.num_preempted > 0, "the pool was meant to run dry"
        finally:
            engine.close()
    assert [r.answer() for r in together] == [r.answer() for r in solo]


def _handoff(prefill: Engine, decode: Engine, store: MemoryStore, work_prompt: object, key: str) -> tuple[str, str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, ignore_eos=True)
    first = run_one(prefill, Work(work_prompt, params, handoff_key=key), 1)  # type: ignore[arg-type]
    handoff = first.events[-1].handoff
    assert handoff is not None
    resume = resume_from(handoff, work_prompt.num_tokens, store.fetch, decode.kv_layout,  # type: ignore[attr-defined]
                         decode.runner.wire_shape, 10.0)
    assert resume.kv is not None, resume.why
    rest = run_one(decode, Work(work_prompt, params, resume=resume), 1)  # type: ignore[arg-type]
    alone = run_one(decode, Work(work_prompt, params), 1)  # type: ignore[arg-type]
    return first.texts.get(0, "") + rest.texts.get(0, ""), alone.texts.get(0, "")


def test_handoff_between_tp2_and_tp1_workers(tiny_model_dirs: dict[str, Path]) -> None:
    """A prompt prefilled at size 2 continues at size 1 and the other way round: blocks travel with every head
    (rank 0 gathers them from the ranks, or scatters each rank its heads)."""
    model_dir = tiny_model_dirs["qwen2_5_vl"]
    store = MemoryStore()
    one = handoff_engine(model_dir, LanguageHalf(model_dir), store)
    try:
        image = prompts(model_dir, one.lm)[-1]
        with tp_half(model_dir) as lm:
            two = handoff_engine(model_dir, lm, store)
            try:
                joined, alone = _handoff(two, one, store, image, "tp2-to-tp1")
                assert joined == alone
                joined, alone = _handoff(one, two, store, image, "tp1-to-tp2")
                assert joined == alone
            finally:
                two.close()
    finally:
        one.close()


def test_a_model_whose_kv_heads_do_not_divide_is_refused(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(SplitError, match=r"num_key_value_heads 2.*divides 2 K/V heads"):
        LanguageHalf(tiny_model_dirs["llava"], tp_rank=0, tp_size=4)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4 does not divide the model's num_key_value_heads 2"):
        check_kv_fits(tiny_model_dirs["llava"], dtype="auto", device="cpu", block_size=16, max_model_len=0,
                      kv_cache_memory=0, ranks=4)  # epd-decoder's check before any weight loads: exit 2


def test_a_rank_that_cannot_start_stops_the_start_with_one_line(tmp_path: Path) -> None:
    ranks = Ranks.spawn(str(tmp_path / "no-such-model"), 2, dtype="auto", device=torch.device("cpu"),
                        quantized="auto")
    with pytest.raises(RankStartError, match=r"^tensor-parallel rank 1 could not start: \w+: [^\n]+$"):
        ranks.connect()
    assert all(p.poll() is not None for p in ranks.procs)
