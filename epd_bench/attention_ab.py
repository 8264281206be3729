"""The CPU decode attention kernel against the gather + SDPA path it replaced (`--cpu-sdpa-attention`): the engine
alone (no HTTP), output tokens/s by rows in flight, both engines in this process on the same weights.

    python -m epd_bench.attention_ab [--model bench-peer] [--levels 16,64] [--rounds 2] [--prompt-len 256]
                                     [--output-len 128]

Prompts of random token ids that are not special tokens (new for every run), greedy, `ignore_eos`; each level runs
on both engines in turn (which goes first alternates), `--rounds` times, 2 threads, 1 GiB of K/V each, at most 64
sequences. Prints both rates and kernel ÷ SDPA per round (docs/BENCHMARKS.md, "Attention over blocks").
"""
from __future__ import annotations

from epd_bench.engine_alone import AB_ENGINE, ab_model, ab_parser, ab_rounds, engine


def main(argv: list[str] | None = None) -> None:
    p = ab_parser("attention_ab", __doc__)
    args = p.parse_args(argv)
    from epd_models.halves import LanguageHalf

    model = ab_model(args)
    lm = LanguageHalf(model, dtype="float32")
    engines = {"kernel": engine(lm, **AB_ENGINE), "SDPA": engine(lm, cpu_sdpa_attention=True, **AB_ENGINE)}
    if engines["kernel"].runner.cache.decode_kernel is None:
        for e in engines.values():
            e.close()
        p.error("the kernel could not be had here (the decoder's warning above says why)")
    ab_rounds(engines, model, args)


if __name__ == "__main__":
    main()
