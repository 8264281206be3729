"""LoRA linears at real shapes, for `make gpu-check`: the ways one LoRA'd linear can add 8 adapters of rank 16 to 16
interleaved decode rows (each row its own adapter, as a mixed batch decodes), against the base linear alone.

    python -m epd_bench.gpu_check_lora [--device auto] [--small] [--json]

- `mask` (what epd_models/lora/layers.py runs for interleaved rows): every adapter's A and B side by side,
  `((x @ A_cat.T) * mask) @ B_cat.T`: two matmuls however many adapters;
- `loop`: per adapter, its rows gathered, `x @ A.T @ B.T`, added back (a gather, two matmuls and a scatter each);
- `grouped`: rows sorted by adapter, torch's grouped matmul (`torch._grouped_mm`, offsets per adapter) twice, then
  scattered back: one kernel per matmul for all adapters (CUDA, bf16; where torch has none, its error is recorded).

Shapes: Qwen2.5-VL-7B's q_proj (3584 -> 3584) and down_proj (18944 -> 3584); --small 256 -> 256 (the CPU dry run).
Each form's mean microseconds per call (after warm-up, between device syncs), ÷ the base linear's, and its largest
difference from `mask` (they compute the same thing). Keep whichever is faster: `fastest` names it."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from epd_bench.micro import emit, parser, sync

SHAPES = {"q_proj": (3584, 3584), "down_proj": (18944, 3584)}  # (in, out) features
SMALL_SHAPES = {"q_proj": (256, 256)}
ADAPTERS, RANK, ROWS = 8, 16, 16


def forms(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
          ) -> dict[str, Callable[[], torch.Tensor]]:
    """Each form of x @ w.T plus each row's adapter (`slots[row]`; a: (G, r, in), b: (G, out, r))."""
    groups, rank = a.shape[0], a.shape[1]
    a_cat, b_cat = a.reshape(groups * rank, -1), b.permute(1, 0, 2).reshape(b.shape[1], groups * rank)
    mask = (torch.arange(groups * rank, device=x.device) // rank == slots[:, None]).to(x.dtype)
    order = torch.argsort(slots)
    offs = torch.cumsum(torch.bincount(slots, minlength=groups), 0).to(torch.int32)
    members = [(g, torch.nonzero(slots == g).flatten()) for g in range(groups)]
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()

    def base() -> torch.Tensor:
        return torch.nn.functional.linear(x, w)

    def masked() -> torch.Tensor:
        return base() + ((x @ a_cat.T) * mask) @ b_cat.T

    def loop() -> torch.Tensor:
        y = base()
        for g, rows in members:
            y.index_add_(0, rows, (x[rows] @ a[g].T) @ b[g].T)
        return y

    def grouped() -> torch.Tensor:
        h = torch._grouped_mm(x[order], a_t, offs=offs)
        y = base()
        y[order] += torch._grouped_mm(h, b_t, offs=offs)
        return y

    return {"base": base, "mask": masked, "loop": loop, "grouped": grouped}


def mean_us(fn: Callable[[], torch.Tensor], device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e6


def measure(device: str = "auto", small: bool = False, iters: int = 200) -> dict[str, Any]:
    where = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                         "cpu" if device == "auto" else device)
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu",
                           "dtype": str(dtype).removeprefix("torch."), "adapters": ADAPTERS, "rank": RANK,
                           "rows": ROWS, "iters": iters, "linears": {}}
    for name, (fin, fout) in (SMALL_SHAPES if small else SHAPES).items():
        def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(where, dtype)

        x, w = rand(ROWS, fin, scale=1.0), rand(fout, fin)
        a, b = rand(ADAPTERS, RANK, fin), rand(ADAPTERS, fout, RANK)
        slots = (torch.arange(ROWS) % ADAPTERS).to(where)  # interleaved: every adapter's rows apart
        row: dict[str, Any] = {"in": fin, "out": fout}
        calls = forms(x, w, a, b, slots)
        want = calls["mask"]().float()
        for form, fn in calls.items():
            try:
                got = fn().float()
                row[form] = {"us": round(mean_us(fn, where, iters), 2),
                             **({"max_diff": float((got - want).abs().max())} if form != "base" else {})}
            except Exception as exc:  # noqa: BLE001 - recorded: a form this torch or device does not run
                row[form] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        base_us = row["base"]["us"]
        timed = {f: row[f]["us"] for f in ("mask", "loop", "grouped") if "us" in row[f]}
        for form in timed:
            row[form]["over_base"] = round(timed[form] / base_us, 2)
        row["fastest"] = min(timed, key=timed.__getitem__)
        out["linears"][name] = row
    return out


def text(result: dict[str, Any]) -> str:
    lines = [f"{result['device']} {result['dtype']}: {result['adapters']} adapters of rank {result['rank']}, "
             f"{result['rows']} interleaved rows"]
    for name, row in result["linears"].items():
        forms_text = ", ".join(f"{f} {row[f]['us']} us ({row[f].get('over_base', 1.0)}x)" if "us" in row[f]
                               else f"{f} n/a" for f in ("base", "mask", "loop", "grouped"))
        lines.append(f"  {name} {row['in']}->{row['out']}: {forms_text}; fastest {row['fastest']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("gpu_check_lora", __doc__)
    p.add_argument("--device", default="auto")
    p.add_argument("--small", action="store_true", help="one 256 -> 256 linear (the CPU dry run)")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    print(f"python -m epd_bench.gpu_check_lora --device {args.device}{' --small' if args.small else ''}", flush=True)
    emit(measure(args.device, args.small, args.iters), args.json, text, indent=1)


if __name__ == "__main__":
    main()
