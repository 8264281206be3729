"""Where speculation stops paying as the batch grows: the engine alone (no HTTP), n-gram speculation with no batch
cut-off against none, output tokens/s by rows in flight. It chose `disable_by_batch_size`'s default
(decoder_service/engine/spec/config.py; docs/BENCHMARKS.md, "Speculative decoding by batch size").

    python -m epd_bench.spec_batch [--model demo] [--levels 1,4,8,16,24] [--rounds 2]

The workload is epd_bench/spec_compare.py's (random prefixes followed by the model's own greedy continuation, so the
answers repeat their prompt), 96 greedy tokens each, `ignore_eos`, both engines in this process on the same weights
(2 threads), each level run on both in turn, `--rounds` times; prints on ÷ off per round.
"""
from __future__ import annotations

from pathlib import Path

from epd_bench.engine_alone import engine, rate
from epd_bench.micro import parser

TOKENS = 96


def main(argv: list[str] | None = None) -> None:
    p = parser("spec_batch", __doc__, json_help=None)
    p.add_argument("--model", default="demo")
    p.add_argument("--levels", default="1,4,8,16,24")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    from decoder_service.engine.spec.config import SpecConfig
    from decoder_service.engine.work import Prompt
    from epd_bench.spec_prompts import primed_prompts
    from epd_contracts.sampling import SamplingParams
    from epd_models.halves import LanguageHalf
    from epd_models.resolve import resolve_model

    torch.set_num_threads(2)
    model = Path(resolve_model(args.model))
    lm = LanguageHalf(model, dtype="float32")
    levels = [int(x) for x in args.levels.split(",")]
    prompts = [Prompt(torch.tensor([ids]), []) for ids in primed_prompts(model, max(levels), 64, 64, 0)]
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    cfg = {"max_num_seqs": 32, "max_model_len": 1024, "kv_cache_memory": 1 << 28}
    on = engine(lm, speculative_config=SpecConfig(num_speculative_tokens=4, disable_by_batch_size=1 << 20), **cfg)
    off = engine(lm, **cfg)
    try:
        for e in (on, off):  # warm
            rate(e, prompts[:1], params)
        for n in levels:
            ratios = [rate(on, prompts[:n], params) / rate(off, prompts[:n], params) for _ in range(args.rounds)]
            print(f"{n} in flight: n-gram on / off output tokens/s {', '.join(f'{r:.2f}' for r in ratios)}",
                  flush=True)
    finally:
        on.close()
        off.close()


if __name__ == "__main__":
    main()
