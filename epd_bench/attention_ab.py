"""The CPU decode attention kernel against the gather + SDPA path it replaced (`--cpu-sdpa-attention`): the engine
alone (no HTTP), output tokens/s by rows in flight, both engines in this process on the same weights.

    python -m epd_bench.attention_ab [--model bench-peer] [--levels 16,64] [--rounds 2] [--prompt-len 256]
                                     [--output-len 128]

Prompts of random token ids that are not special tokens (new for every run), greedy, `ignore_eos`; each level runs
on both engines in turn, `--rounds` times, 2 threads, 1 GiB of K/V each, at most 64 sequences. Prints both rates
and kernel ÷ SDPA per round (docs/BENCHMARKS.md, "Attention over blocks").
"""
from __future__ import annotations

from pathlib import Path

from epd_bench.engine_alone import engine, random_prompts, rate
from epd_bench.micro import parser


def main(argv: list[str] | None = None) -> None:
    p = parser("attention_ab", __doc__, json_help=None)
    p.add_argument("--model", default="bench-peer", help="a checkpoint dir, `demo` or a bench preset")
    p.add_argument("--levels", default="16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args(argv)
    import torch

    from epd_contracts.sampling import SamplingParams
    from epd_models.halves import LanguageHalf
    from epd_models.resolve import resolve_model

    torch.set_num_threads(2)
    model = Path(resolve_model(args.model))
    lm = LanguageHalf(model, dtype="float32")
    prompts = random_prompts(model, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    cfg = {"max_num_seqs": 64, "max_model_len": 2048, "kv_cache_memory": 1 << 30}
    engines = {"kernel": engine(lm, **cfg), "sdpa": engine(lm, cpu_sdpa_attention=True, **cfg)}
    try:
        if engines["kernel"].runner.cache.decode_kernel is None:
            p.error("the kernel could not be had here (the decoder's warning above says why)")

        for e in engines.values():  # warm
            rate(e, prompts(1), params)
        for n in (int(x) for x in args.levels.split(",")):
            for _ in range(args.rounds):
                got = {name: rate(e, prompts(n), params) for name, e in engines.items()}
                print(f"{n} in flight: kernel {got['kernel']:.1f} tok/s, SDPA {got['sdpa']:.1f}, kernel / SDPA "
                      f"{got['kernel'] / got['sdpa']:.2f}", flush=True)
    finally:
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
