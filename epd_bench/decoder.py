"""Decoder engine: output tokens/s by concurrency, inter-token latency while image prefills arrive, the host cost
of a decode step, and the K/V memory a budget holds.

    python -m epd_bench.decoder [--json] [--max-prefill-tokens N]
    python -m epd_bench.decoder --base 7888cf9 [--repeats 3] [--json]   # this tree beside an older revision

Builds a "small" random LLaVA (LM hidden 256, 4 layers; CLIP 224/14, 256 image tokens per image) in a
temp dir and drives the real `Engine` in this process (no HTTP, no encoders: image features come from
the vision half directly); epd_bench/decoder_worker.py holds the measurements.
- Throughput: rounds of C requests submitted at once (at least 16 requests per C; text prompts of
  10-50 words, 64 new tokens each, greedy, EOS ignored); output tokens / wall time, C = 1, 4, 16, 64.
- ITL: 8 text streams of 96 tokens alone, then the same with 8 four-image prompts (about 1050 prompt
  tokens each) submitted after the streams' 16th token; p50/p99 of the gaps between consecutive
  tokens of the 8 streams from then until every image prompt has its first token.
- step_host_us_per_row (rows = 16 and 64): that many requests at once (prompts as above, 192 new tokens each);
  for each decode step (every running sequence decoding, none waiting or prefilling, one token per row in
  the forward) the step's wall time minus its forward (inside the LM's decoder stack and lm_head), divided
  by the rows; the median over those steps, with a breakdown by phase (schedule, runner, forward, postprocess,
  read_back, other), and from a second run with per-row hooks postprocess split into sampling, accept (stop
  checks, metrics), detokenize and events. Taken from outside the engine by wrapping its methods in this
  process (epd_bench/step_clock.py says exactly which), so the same code measures any revision.
- memory (this tree, paged engine only): epd_bench/decoder_memory.py, on bench-lm with a 1 GiB K/V budget.
With `--base REV` the revision is exported with `git archive` (epd_bench/revisions.py) and the speed parts
(C = 16, 64 and the host cost) run in a process of their own for each tree, `--repeats` times in alternating
order; each value is the median of its runs, and the ratios are this tree ÷ the base.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from epd_bench.micro import ROOT, emit, parser

WORKER = Path(__file__).with_name("decoder_worker.py")
TARGETS = {"speedup_16_vs_1_min": 4, "itl_p99_ratio_during_image_prefill_max": 3,
           "tokens_per_s_new_vs_base_min": 1.0, "step_host_us_per_row_64_new_vs_base_max": 0.5,
           "memory_paged_vs_slots_min": 8}


def run_worker(tree: Path, parts: str, extra: list[str]) -> dict[str, Any]:
    """decoder_worker.py (this tree's file) on the code in `tree`, in a process of its own; its JSON line."""
    code = (f"import runpy, sys; sys.argv = ['decoder_worker', '--parts', {parts!r}, *{extra!r}]; "
            f"runpy.run_path({str(WORKER)!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as cwd:  # python -c puts the cwd first on sys.path: an empty one
        done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"decoder worker on {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median of the runs' numbers (nested dicts alike)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) for k in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return round(statistics.median(runs), 1)
    return first


def compare(base: str, repeats: int, extra: list[str], new: Path = ROOT) -> dict[str, Any]:
    from epd_bench.revisions import export_revision  # it imports the tiny-model builders: not for --help

    sha, tree = export_revision(base)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    for r in range(repeats):
        for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
            runs[name].append(run_worker(tree if name == "base" else new, "speed", extra))
    before, after = median_of(runs["base"]), median_of(runs["new"])
    tps, host = "output_tokens_per_s", "step_host_us_per_row"
    ratios = {f"tokens_per_s_{c}_new_vs_base": round(after[tps][c] / before[tps][c], 2) for c in ("16", "64")}
    ratios.update({f"step_host_us_per_row_{n}_new_vs_base": round(after[host][n]["host_us_per_row"]
                                                                  / before[host][n]["host_us_per_row"], 2)
                   for n in ("16", "64") if after[host][n] and before[host][n]})
    return {"base": sha, "repeats": repeats, "base_result": before, "new_result": after, "ratios": ratios,
            "runs": runs}


def main(argv: list[str] | None = None) -> None:
    p = parser("decoder", __doc__, "print one JSON object")
    p.add_argument("--max-prefill-tokens", type=int, help="default: the decoder's own default")
    p.add_argument("--base", help="a git revision to run beside this tree (the speed parts), e.g. 7888cf9")
    p.add_argument("--repeats", type=int, default=3, help="with --base: runs of each tree, alternating")
    p.add_argument("--no-memory", action="store_true", help="skip the K/V memory run (a few minutes)")
    p.add_argument("--tree", type=Path, default=ROOT, help="with --base: the code to run as the new side (default: "
                   "this working tree; e.g. an exported revision)")
    args = p.parse_args(argv)
    # not given: each tree's worker keeps its own default (an older revision's was 32, and it refuses 0)
    extra = [] if args.max_prefill_tokens is None else ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    if args.max_prefill_tokens is None:
        from decoder_service.config import DecoderConfig  # after parsing: --help answers without torch

        args.max_prefill_tokens = DecoderConfig().max_prefill_tokens
    result: dict[str, Any] = {"model": "small llava (LM hidden 256, 4 layers)", "max_num_seqs": 64,
                              "max_prefill_tokens": args.max_prefill_tokens}
    if args.base:
        result.update(compare(args.base, args.repeats, extra, args.tree.resolve()))
    else:
        out = run_worker(ROOT, "speed,latency", extra)
        tps = out["output_tokens_per_s"]
        result.update(out, speedup_16_vs_1=round(tps["16"] / tps["1"], 2), speedup_64_vs_1=round(tps["64"] / tps["1"], 2))
    if not args.no_memory:
        result["memory"] = run_worker(ROOT, "memory", extra)["memory"]
    result["targets"] = TARGETS
    emit(result, True, indent=None if args.json else 2)


if __name__ == "__main__":
    main()
