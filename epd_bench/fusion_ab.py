"""The fused CPU gated MLP and RMSNorm (decoder_service/engine/cpu_fusion.py, the default with the packed linears)
against transformers' own forwards on the same packed linears: the engine alone (no HTTP), output tokens/s by rows
in flight, both engines in this process, each on its own copy of the weights (fusing changes the modules).

    python -m epd_bench.fusion_ab [--model bench-peer] [--levels 16,64] [--rounds 2] [--prompt-len 256]
                                  [--output-len 128]

As epd_bench.attention_ab: prompts of random token ids, greedy, `ignore_eos`, both engines in turn at each level
(which goes first alternates), 2 threads, 1 GiB of K/V each, at most 64 sequences. Prints both rates and fused ÷
unfused per round (docs/BENCHMARKS.md, "The gated MLP and RMSNorm fused").
"""
from __future__ import annotations

from epd_bench.engine_alone import AB_ENGINE, ab_model, ab_parser, ab_rounds, engine


def main(argv: list[str] | None = None) -> None:
    args = ab_parser("fusion_ab", __doc__).parse_args(argv)
    from decoder_service.engine import cpu_fusion
    from epd_models.halves import LanguageHalf

    model = ab_model(args)
    fused = engine(LanguageHalf(model, dtype="float32"), **AB_ENGINE)
    fuse, cpu_fusion.fuse_model = cpu_fusion.fuse_model, lambda module: "not fused (epd_bench.fusion_ab)"
    try:
        unfused = engine(LanguageHalf(model, dtype="float32"), **AB_ENGINE)
    except BaseException:
        fused.close()
        raise
    finally:
        cpu_fusion.fuse_model = fuse
    ab_rounds({"fused": fused, "unfused": unfused}, model, args)


if __name__ == "__main__":
    main()
