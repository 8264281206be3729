"""Output tokens/s with LoRA adapters mixed in the batch ÷ the base model alone, in the engine (no HTTP): the cost of
serving many adapters in one step (each LoRA'd linear adds, per adapter present, two small matmuls over its rows).

    python -m epd_bench.lora_mix [--model bench-peer] [--adapters 8] [--rank 16] [--in-flight 16] [--rounds 3]
                                 [--prompt-len 128] [--output-len 64] [--device cpu]

Two engines in this process, on two copies of the model, each with the decoder's defaults (2 threads on the CPU):
one without --enable-lora (the base alone), one serving `--adapters` adapters of `--rank` on every attention and MLP
linear of the language model (random weights written in the PEFT format, as `--lora-modules` reads them), whose
requests take the adapters in turn. Prompts are random token ids, greedy, `ignore_eos`, all submitted together;
rounds alternate which engine goes first. Prints each round's tokens/s and the median ratio.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from epd_bench.engine_alone import engine, random_prompts, rate
from epd_bench.micro import parser


def write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> Path:
    """A PEFT-format adapter of `rank` on every linear in `shapes` (epd_models.lora.peft_format.linear_shapes)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fin, fout) in shapes.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin ** 0.5
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) / rank ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                            "target_modules": sorted({n.rsplit(".", 1)[1]
                                                                                      for n in shapes})}))
    return folder


def main(argv: list[str] | None = None) -> None:
    p = parser("lora_mix", __doc__, json_help=None)
    p.add_argument("--model", default="bench-peer", help="a checkpoint dir, `demo` or a bench preset")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    import torch

    from epd_common.lora_flags import LoRAModule
    from epd_contracts.sampling import SamplingParams
    from epd_models.halves import LanguageHalf
    from epd_models.lora.peft_format import linear_shapes
    from epd_models.resolve import resolve_model

    if args.device == "cpu":
        torch.set_num_threads(2)
    model = Path(resolve_model(args.model))
    random_batch = random_prompts(model, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    common: dict[str, Any] = {"max_num_seqs": max(args.in_flight, 1), "max_model_len": 1024,
                              "kv_cache_memory": 512 << 20, "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        base_lm = LanguageHalf(model, device=args.device)
        shapes = linear_shapes(base_lm.module)
        modules = tuple(LoRAModule(f"lora{i}", str(write_adapter(Path(tmp) / f"lora{i}", shapes, args.rank, i)))
                        for i in range(args.adapters))
        engines = {"base": engine(base_lm, **common),
                   "mixed": engine(LanguageHalf(model, device=args.device), enable_lora=True, lora_modules=modules,
                                   max_loras=args.adapters, max_lora_rank=max(args.rank, 16), **common)}
        slots = [engines["mixed"].lm.lora.slot(m.name) for m in modules]

        def prompts(lora: bool) -> list[Any]:
            out = random_batch(args.in_flight)
            return [replace(q, lora=slots[i % len(slots)]) for i, q in enumerate(out)] if lora else out

        rates: dict[str, list[float]] = {"base": [], "mixed": []}
        try:
            for name, e in engines.items():
                rate(e, prompts(name == "mixed")[:2], params)  # warm
            for r in range(args.rounds):
                order = ["base", "mixed"] if r % 2 == 0 else ["mixed", "base"]
                for name in order:
                    rates[name].append(rate(engines[name], prompts(name == "mixed"), params))
                print(f"round {r}: base {rates['base'][-1]:.1f} tok/s, {args.adapters} adapters mixed "
                      f"{rates['mixed'][-1]:.1f} tok/s", flush=True)
        finally:
            for e in engines.values():
                e.close()
    ratio = statistics.median(m / b for m, b in zip(rates["mixed"], rates["base"], strict=True))
    print(f"{args.adapters} adapters of rank {args.rank} mixed / base alone, {args.in_flight} in flight: "
          f"{ratio:.3f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
