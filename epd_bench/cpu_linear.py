"""oneDNN's prepacked linears (the decoder's CPU default) against `torch.nn.functional.linear`, by input rows.

    python -m epd_bench.cpu_linear [--rows 1,16,64,256,2048] [--threads 2] [--iters 9] [--json]
    python -m epd_bench.cpu_linear --memory bench-peer [--json]

For each of bench-peer's and Qwen2.5-0.5B's linear shapes (in x out) and each row count, the median time of one
call of each, called in turn (epd_bench/micro.py `interleaved`: machine noise hits both alike), and packed ÷
F.linear. decoder_service/engine/cpu_linear.py runs every input through the packed weight: this is the check that
prefill-sized inputs lose nothing by it. `--memory MODEL`: a decoder engine on MODEL (fp32, 1 GiB of K/V, 64
sequences, context 2048; epd_bench/decoder_worker.py's `Bench`, no HTTP), once with `cpu_exact_linear` and once
packed, each in a process of its own (`PYTHONPATH=runs/revisions/SHA python -P epd_bench/cpu_linear.py
--memory-child MODEL packed` measures an older revision, where packing was `--cpu-packed-linear`): /proc/self/status's VmRSS, RssAnon and RssFile (MiB) after start-up and after
one request (about 400 prompt tokens, 32 new), and VmHWM (the peak, packing included).
"""
from __future__ import annotations

import asyncio
import functools
import json
import statistics
import subprocess
import sys
from typing import Any

from epd_bench.micro import emit, interleaved, parser

# (in, out): bench-peer's q/o, MLP up/gate and down; Qwen2.5-0.5B's MLP up/gate and down
SHAPES = ((1024, 1024), (1024, 2816), (2816, 1024), (896, 4864), (4864, 896))


def measure(rows: list[int], threads: int, iters: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out = []
    for n_in, n_out in SHAPES:
        weight = torch.randn(n_out, n_in)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        for n in rows:
            x = torch.randn(1, n, n_in)
            with torch.inference_mode():
                calls: dict[str, Any] = {"f_linear": functools.partial(F.linear, x, weight),
                                         "packed": functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed,
                                                                     None, "none", [], "")}
                t = interleaved(calls, iters, 2)
            f, p = (statistics.median(t[k]) * 1e3 for k in ("f_linear", "packed"))
            out.append({"shape": f"{n_in}x{n_out}", "rows": n, "f_linear_ms": round(f, 3), "packed_ms": round(p, 3),
                        "packed_over_f_linear": round(p / f, 2)})
    return out


def status_mib() -> dict[str, int]:
    fields = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) >> 10 for k, v in (line.split(":", 1) for line in f) if k in fields}


def memory_child(model: str, exact: bool) -> dict[str, Any]:
    from epd_bench.decoder_worker import Bench, decoder_config
    from epd_models.resolve import resolve_model

    bench = Bench(resolve_model(model), decoder_config(max_num_seqs=64, max_model_len=2048, kv_cache_memory=1 << 30,
                                                       cpu_exact_linear=exact, cpu_packed_linear=not exact),
                  vision=False)  # decoder_config drops the field a revision lacks: an older one's flag was the opt-in
    started = status_mib()
    asyncio.run(bench.run(bench.prompt(200), 32))
    after = status_mib()
    bench.close()
    return {"mode": "exact" if exact else "packed", "started": started, "after_request": after}


def memory(model: str) -> list[dict[str, Any]]:
    """Each mode in a child process (what one holds must not count for the other)."""
    runs = [subprocess.run([sys.executable, "-m", "epd_bench.cpu_linear", "--memory-child", model, mode],
                           check=True, capture_output=True, text=True).stdout for mode in ("exact", "packed")]
    return [json.loads(out.strip().splitlines()[-1]) for out in runs]


def text(result: list[dict[str, Any]]) -> str:
    lines = ["| shape | rows | F.linear ms | packed ms | packed ÷ F.linear |", "|---|---:|---:|---:|---:|"]
    return "\n".join(lines + [f"| {r['shape']} | {r['rows']} | {r['f_linear_ms']} | {r['packed_ms']} | "
                              f"{r['packed_over_f_linear']} |" for r in result])


def main(argv: list[str] | None = None) -> None:
    p = parser("cpu_linear", __doc__)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--memory", metavar="MODEL", help="measure a decoder engine's memory on MODEL instead")
    p.add_argument("--memory-child", nargs=2, metavar=("MODEL", "MODE"), help="(internal) one mode's process")
    args = p.parse_args(argv)
    if args.memory_child:
        emit(memory_child(args.memory_child[0], args.memory_child[1] == "exact"), True)
    elif args.memory:
        emit(memory(args.memory), True, indent=1)
    else:
        emit(measure(args.rows, args.threads, args.iters), args.json, text)


if __name__ == "__main__":
    main()
