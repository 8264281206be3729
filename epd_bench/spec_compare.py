"""Speculative decoding (n-gram prompt lookup) on and off, on a workload whose answers repeat their prompt.

    python -m epd_bench.spec_compare [--model demo] [--rounds 5] [--waves 8] [--levels 1,16] [--no-docs]

Two EPD stacks (proxy, decoder, one idle encoder, as epd_bench/stacks.py starts them) on the same checkpoint, their
decoders alike but for `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}'` on one (`ngram`) and none on the other (`off`). Load (epd_bench/completions_load.py):
POST /v1/completions, greedy, `ignore_eos`, 128 new tokens, at 1 in flight (mean TPOT: does speculation pay for
one stream?) and 16 (output tokens/s: does it cost a loaded decoder anything?); max(8, waves x in flight) requests a
level (8 waves: a level of 16 in flight runs about 5 s); rounds alternate which stack goes first. Each round runs a
level on both stacks back to back, so a round's ngram ÷ off is measured side by side; the targets are the median of
those per-round ratios (a shared machine's load drifts between rounds: it moves both runs of a round alike, while
a ratio of per-system medians can pair one stack's quiet round with the other's busy one). The acceptance rate (accepted ÷
proposed tokens) and the acceptance at each draft position come from the ngram decoder's /metrics
(`epd_decoder_spec_decode_*`), read before and after each level's runs. A greedy check: one prompt's answer must be
the same text from both stacks (speculation must not change a greedy answer).

The workload, and why its answers repeat their prompt. The demo and bench checkpoints are not language models: the
demo's 2-layer LM was trained only to name the colour or the shape of a synthetic image
(epd_builders/demo_train.py), the bench ones have random weights; neither extracts or rewrites a passage it is
shown. What they do instead, kept going past their end (`ignore_eos`, greedy): the demo model's answer turns within
a few tokens into a loop over the few words it was trained to say ("blue", "square", "triangle", ...: spans of 3 to
6 tokens repeated, drifting between them), and a random bench model's wanders among a handful of tokens, often
settling on one. So each prompt is a random prefix (64 token ids) followed by the model's own greedy continuation of
it (64 tokens, epd_bench/spec_prompts.py): the answer continues that continuation, its loop is already in the
prompt, and the n-gram lookup finds its spans there from the first decode step, as it would find the passage an
extraction or a form-filling answer copies. Replayed offline with k = 4 (12 prompts,
decoder_service/engine/spec/ngram.py's proposer over transformers' greedy answers), on the demo model 66% of the
proposed tokens are accepted and a step yields 3.4 tokens (2.9 with the random prefix alone, the loop only in the
answer); on bench-lm 67% and 3.2 (2.8). This is a workload made to repeat: on answers that do not, the proposer
finds nothing and a step is the plain one plus the lookup. Results go to runs/spec-compare/<time>/summary.json;
docs/BENCHMARKS.md's `spec-bench` section is rewritten.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from epd_bench import report
from epd_bench.completions_load import Target, greedy_text, measure
from epd_bench.report import DOCS, ROOT, finish, format_targets, write_section
from epd_bench.stacks import RunStart, SystemSpec, epd, started

NGRAM, OFF = "ngram", "off"
NAME = "spec-bench"  # the docs section's markers
SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
CONTEXT, MAX_SEQS = 1024, 16
WAVES = 8  # a level sends max(8, WAVES x in flight) requests
SPEC = "epd_decoder_spec_decode_"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
METRICS = ("output_tok_s", "mean_tpot_ms", "mean_ttft_ms")


def system(name: str, model_dir: Path, threads: int, pin: bool, spec: str | None) -> SystemSpec:
    """EPD with its decoder on every core, fp32; `spec`: its --speculative-config (None: off)."""
    flags = ("--max-model-len", str(CONTEXT), "--max-num-seqs", str(MAX_SEQS), "--dtype", "float32",
             *(("--speculative-config", spec) if spec else ()))
    return epd(model_dir, 1, threads, pin, decoder_all_cores=True, decoder_flags=flags, name=name)


def make_prompts(model_dir: Path, num: int, args: argparse.Namespace, seed: int) -> list[list[int]]:
    """The primed prompts (epd_bench/spec_prompts.py), made in a child process so this one never imports torch."""
    proc = subprocess.run([sys.executable, "-m", "epd_bench.spec_prompts", "--model-dir", str(model_dir), "--num",
                           str(num), "--prefix-len", str(args.prefix_len), "--primer-len", str(args.primer_len),
                           "--seed", str(seed)], check=True, capture_output=True, text=True)
    return list(json.loads(proc.stdout.strip().splitlines()[-1])["prompts"])


def spec_counts(text: str) -> dict[str, float]:
    """The spec_decode counters of one /metrics page: each counter's value, and `pos<i>` per draft position."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(SPEC):
            continue
        name, value = line.rsplit(" ", 1)
        key = name.removeprefix(SPEC).removesuffix("_total")
        if key.startswith("num_accepted_tokens_per_pos_total{"):
            key = "pos" + key.split('"')[1]
        out[key] = float(value)
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the counters say of the runs between two scrapes: drafts, tokens proposed and accepted, the rate, and
    the share of drafts whose position i was accepted."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts, proposed = d.get("num_drafts", 0.0), d.get("num_draft_tokens", 0.0)
    positions = sorted((k for k in d if k.startswith("pos")), key=lambda k: int(k[3:]))
    return {"drafts": drafts, "draft_tokens": proposed, "accepted_tokens": d.get("num_accepted_tokens", 0.0),
            "rate": report.ratio(d.get("num_accepted_tokens"), proposed),
            "per_position": [report.ratio(d[k], drafts) for k in positions]}


def scrape(url: str | None) -> dict[str, float]:
    return spec_counts(httpx.get(f"{url}/metrics", timeout=30).text) if url else {}


def run_rounds(targets: dict[str, Target], decoders: dict[str, str | None], prompts: list[list[int]],
               args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results[level][system] = one summary per round, acceptance[level] over every round); `prompts`: enough for
    every round and level, each used once (the same ones for both stacks)."""
    names, fresh = list(targets), iter(prompts)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {n: [] for n in names} for c in args.levels}
    totals: dict[str, dict[str, float]] = {str(c): {} for c in args.levels}  # level -> counter -> sum of deltas
    for rnd in range(args.rounds):
        for c in args.levels:
            batch = [next(fresh) for _ in range(per_level(c, args.waves))]
            for name in names if rnd % 2 == 0 else names[::-1]:
                print(f"[{time.strftime('%H:%M:%S')}] round {rnd}, {c} in flight, on {name}", flush=True)
                before = scrape(decoders.get(name)) if name == NGRAM else {}
                results[str(c)][name].append(measure(targets[name], batch, c, args.output_len))
                for key, value in (scrape(decoders.get(name)) if name == NGRAM else {}).items():
                    totals[str(c)][key] = totals[str(c)].get(key, 0.0) + value - before.get(key, 0.0)
    return results, {level: acceptance({}, counts) for level, counts in totals.items()}


def per_level(in_flight: int, waves: int = WAVES) -> int:
    """Requests one level sends: `waves` of them, at least 8."""
    return max(8, waves * in_flight)


def medians(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """level -> system -> metric -> the median over rounds (None when any round failed: not a measurement)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for level, systems in results.items():
        out[level] = {}
        for name, runs in systems.items():
            whole = bool(runs) and all(r["failed"] == 0 and r[METRICS[0]] is not None for r in runs)
            out[level][name] = {m: statistics.median(float(r[m]) for r in runs) if whole else None for m in METRICS}
    return out


def round_ratios(results: dict[str, Any], level: str, metric: str) -> list[float] | None:
    """ngram ÷ off of one metric in each round at one level (the two runs of a round back to back); None unless
    every round of both stacks completed every request."""
    runs = results.get(level, {})
    on, off = runs.get(NGRAM, []), runs.get(OFF, [])
    if not on or len(on) != len(off) or any(r["failed"] or not r[metric] for r in on + off):
        return None
    return [float(a[metric]) / float(b[metric]) for a, b in zip(on, off, strict=True)]


def paired(results: dict[str, Any], level: str, metric: str) -> float | None:
    """The median over rounds of each round's ngram ÷ off (what the targets judge)."""
    found = round_ratios(results, level, metric)
    return statistics.median(found) if found else None


def targets(s: dict[str, Any]) -> list[report.Target]:
    """Issue 48's: mean TPOT at the lowest level, ngram ÷ off, <= 0.7 (it pays); output tokens/s at the highest,
    >= 1.0 (under load it does not lose: past disable_by_batch_size rows a step proposes nothing)."""
    results, levels = s["results"], [str(c) for c in s["levels"]]
    if not levels:
        return []
    low, high = levels[0], levels[-1]
    return [report.Target("spec_tpot", f"{low} in flight: mean TPOT, ngram ÷ off (median of rounds)",
                          paired(results, low, METRICS[1]), 0.7, "<="),
            report.Target("spec_throughput", f"{high} in flight: output tokens/s, ngram ÷ off (median of rounds)",
                          paired(results, high, METRICS[0]), 1.0, ">=")]


def tables(s: dict[str, Any]) -> list[str]:
    """Medians and ngram ÷ off per level with the acceptance, then every round's output tokens/s and ratio."""
    meds, acc, f, results = s["medians"], s["acceptance"], report.fmt, s["results"]
    lines = ["### Medians", "", "| in flight | off tok/s | ngram tok/s | ngram ÷ off tok/s | off TPOT ms | ngram TPOT ms "
             "| ngram ÷ off TPOT | accepted ÷ proposed | accepted at draft position 0, 1, 2, ... | drafts |",
             "|---:|" + "---:|" * 6 + "---:|---|---:|"]
    for level, systems in meds.items():
        o, n, a = systems.get(OFF, {}), systems.get(NGRAM, {}), acc.get(level, {})
        per_pos = ", ".join(f(p, 2) for p in a.get("per_position", [])) or "–"
        lines.append(f"| {level} | {f(o.get(METRICS[0]))} | {f(n.get(METRICS[0]))} | "
                     f"{f(paired(results, level, METRICS[0]), 2)} | {f(o.get(METRICS[1]), 2)} | "
                     f"{f(n.get(METRICS[1]), 2)} | {f(paired(results, level, METRICS[1]), 2)} | {f(a.get('rate'), 2)} | "
                     f"{per_pos} | {f(a.get('drafts'), 0)} |")
    lines += ["", "### Every round", "", "| in flight | system | output tok/s per round | mean TPOT ms per round | "
              "failed requests |", "|---:|---|---|---|---:|"]
    for level, systems in s["results"].items():
        lines += [f"| {level} | {name} | {', '.join(f(r['output_tok_s']) for r in runs)} | "
                  f"{', '.join(f(r['mean_tpot_ms'], 2) for r in runs)} | {sum(r['failed'] for r in runs)} |"
                  for name, runs in systems.items()]
        tok, tpot = (round_ratios(results, level, m) or [] for m in METRICS[:2])
        lines.append(f"| {level} | ngram ÷ off | {', '.join(f(r, 2) for r in tok) or '–'} | "
                     f"{', '.join(f(r, 2) for r in tpot) or '–'} | |")
    return lines + [""]


def render(s: dict[str, Any]) -> str:
    same = (s.get("greedy_check") or {}).get("same")
    greedy = ("The greedy check needs both stacks." if same is None else "Greedy check: one prompt's answer is "
              + ("the same text from both stacks." if same else "**different** between the stacks (summary.json)."))
    intro = (f"Model `{s['model']}`, fp32, context {s['context']}, at most {s['max_num_seqs']} sequences, "
             f"{s['threads']} threads{', pinned' * s['pinned']}; the `ngram` decoder runs `--speculative-config "
             f"'{s['spec_config']}'`, the `off` one none. Load: `/v1/completions`, each prompt {s['prefix_len']} "
             f"random token ids followed by the model's own greedy continuation of them ({s['primer_len']} tokens; "
             f"new prompts every round and level, the same for both), {s['output_len']} new tokens, `ignore_eos`, "
             f"greedy; max(8, {s.get('waves', 4)} × in flight) requests per level; {s['rounds']} rounds alternate "
             "which stack goes first, each running a level on both back to back. ngram ÷ off (the targets and the "
             "medians table): the median over rounds of each round's ratio; the other columns: medians over rounds. "
             "TPOT is each run's mean. Acceptance: the `ngram` decoder's "
             "`epd_decoder_spec_decode_*` counters over every round of a level (a position's share: drafts whose "
             "token at that position was accepted). Why these answers repeat their prompt, and what that does not "
             f"show: `epd_bench/spec_compare.py`'s docstring. {greedy}")
    body = [*report.left_out({**s, "results": {}}), *report.target_rows(targets(s), 2), *tables(s),
            *report.commands_block({**s, "commands": {}})]
    return report.section(NAME, "Speculative decoding: n-gram lookup on and off, answers that repeat their prompt",
                          f"{s['command']}    # `make bench-spec` (and `make bench`) run it with $(BENCH_SPEC_ARGS)",
                          s, intro, body)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: every server started is stopped
    run = RunStart.of(args)
    pin = run.pin and len(os.sched_getaffinity(0)) >= args.threads
    factories: dict[str, Callable[[], SystemSpec]] = {
        OFF: lambda: system(OFF, run.model_dir, args.threads, pin, None),
        NGRAM: lambda: system(NGRAM, run.model_dir, args.threads, pin, args.spec_config)}
    # every prompt made at once, before any stack is loaded (one child process; seconds)
    warm_n = 2 * max(args.levels)
    need = warm_n + args.rounds * sum(per_level(c, args.waves) for c in args.levels)
    prompts = make_prompts(run.model_dir, need, args, seed=0)
    with started(factories, run.run_dir / "logs", args.start_timeout) as (up, skipped):
        startup_s = round(time.monotonic() - run.started, 1)
        peers = {r.spec.name: Target(r.spec.url, r.spec.model) for r in up}
        decoders = {r.spec.name: r.spec.decoder_url for r in up}
        for t in peers.values():
            measure(t, prompts[:warm_n], max(args.levels), 16)  # not measured: first steps, allocations
        texts = {name: greedy_text(t, prompts[0], args.output_len) for name, t in peers.items()}
        same = {"texts": texts, "same": len(set(texts.values())) == 1 if len(texts) > 1 else None}
        results, accepted = run_rounds(peers, decoders, prompts[warm_n:], args) if peers else ({}, {})
    s = run.summary(args.model, [r.spec for r in up], skipped, threads=args.threads, pinned=pin, rounds=args.rounds,
                    waves=args.waves, levels=list(args.levels), prefix_len=args.prefix_len, primer_len=args.primer_len,
                    output_len=args.output_len, context=CONTEXT, max_num_seqs=MAX_SEQS, spec_config=args.spec_config,
                    startup_s=startup_s, greedy_check=same, results=results, medians=medians(results),
                    acceptance=accepted, command=shlex.join(["python", "-m", "epd_bench.spec_compare",
                                                             *(argv if argv is not None else sys.argv[1:])]))
    found = targets(s)
    finish(s, run.run_dir, found, format_targets(found, 44), None if args.no_docs else
           lambda: write_section(args.docs, NAME, render(s), "vllm-bench"), f"{args.docs} ({NAME})")


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    if not levels or min(levels) < 1 or max(levels) > MAX_SEQS:
        raise argparse.ArgumentTypeError(f"in-flight levels must be 1..{MAX_SEQS}: {text!r}")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.spec_compare", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="'demo', a bench preset ('bench', 'bench-lm') or a LLaVA dir")
    p.add_argument("--spec-config", default=SPEC_CONFIG, help="the ngram decoder's --speculative-config")
    p.add_argument("--rounds", type=int, default=5, help="rounds, alternating which stack goes first")
    p.add_argument("--waves", type=int, default=WAVES, help="a level's requests: max(8, waves x in flight)")
    p.add_argument("--levels", type=_levels, default=(1, 16), help="requests in flight, comma-separated")
    p.add_argument("--prefix-len", type=int, default=64, help="random token ids opening each prompt")
    p.add_argument("--primer-len", type=int, default=64, help="the model's greedy tokens after them, in the prompt")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (ignore_eos: every answer this long)")
    p.add_argument("--threads", type=int, default=2, help="cores (and OMP threads) each decoder gets")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds each stack may take to start")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "spec-compare")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if min(args.rounds, args.threads, args.waves) < 1 or args.prefix_len < 4 or args.primer_len < 0 \
            or args.output_len < 2:
        p.error("--rounds, --waves and --threads must be >= 1, --prefix-len >= 4, --primer-len >= 0, "
                "--output-len >= 2")
    if args.prefix_len + args.primer_len + args.output_len > CONTEXT:
        p.error(f"--prefix-len + --primer-len + --output-len must fit the context ({CONTEXT})")
    return args


if __name__ == "__main__":
    main()
