"""The speculative-decoding bench's prompts (epd_bench/spec_compare.py): random token-id prefixes, each followed by
the model's own greedy continuation of it. Run in a child process, so the bench itself never imports torch:

    python -m epd_bench.spec_prompts --model-dir DIR --num 8 --prefix-len 64 --primer-len 64 --seed 0

prints one JSON line, {"prompts": [[id, ...], ...]}. The continuation is transformers' greedy decode in fp32 with
the tokens that print nothing on their own (EOS and the other special tokens, partial UTF-8 bytes) suppressed, as
`ignore_eos` keeps an answer going past its end; no image placeholder can appear in a prompt.
"""
from __future__ import annotations

import json
from pathlib import Path

from epd_bench.completions_load import token_prompts
from epd_bench.micro import parser


def primed_prompts(model_dir: Path, num: int, prefix_len: int, primer_len: int, seed: int) -> list[list[int]]:
    """`num` prompts: `prefix_len` random visible ids, then the model's `primer_len` greedy tokens after them."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from epd_bench.lm_export import prompt_token_ids
    from epd_builders.bench_model import invisible_token_ids

    prefixes = token_prompts(num, prefix_len, prompt_token_ids(model_dir), seed)
    if not primer_len:
        return prefixes
    hidden = invisible_token_ids(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prefixes, dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=primer_len,
                             min_new_tokens=primer_len, do_sample=False, suppress_tokens=hidden, pad_token_id=0)
    return [[int(t) for t in row] for row in out.tolist()]


def main(argv: list[str] | None = None) -> None:
    p = parser("spec_prompts", __doc__, json_help=None)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--num", type=int, required=True)
    p.add_argument("--prefix-len", type=int, default=64)
    p.add_argument("--primer-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts = primed_prompts(args.model_dir, args.num, args.prefix_len, args.primer_len, args.seed)
    print(json.dumps({"prompts": prompts}), flush=True)


if __name__ == "__main__":
    main()
