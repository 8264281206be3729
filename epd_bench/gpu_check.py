"""One command for a machine with a GPU: the parity tests there, then EPD against the aggregated decoder at real sizes.

    python -m epd_bench.gpu_check --out DIR [--device cuda] [--size full|small] [--budget S] [--write-benchmarks MD]

    make gpu-check  =  --device cuda --out runs/gpu-check --write-benchmarks docs/BENCHMARKS.md

Steps, each under its own limit inside the run's --budget (540 s); a failed step is recorded and the next still runs:
env (versions, nvidia-smi); tests (TESTS: the families' split path against model.generate() on --device); then per
family of FAMILIES (LLaVA-1.5-7B, Qwen2.5-VL-3B): build (a random checkpoint of the real shapes drawn on the device,
epd_builders/full_size.py, cached), engine (the paged engine on it: K/V plan at 0.9 utilization, decode CUDA graphs,
TPOT at batch 1 against the HBM bound, tokens/s at 64 rows; speculative decoding's verification step ÷ a plain
decode step at 1 and 16 rows, the n-gram proposer's host time, 16 decode rows with a prompt chunk ÷ without, at the
new default's chunk and the old 32 tokens (epd_bench/gpu_check_spec.py); for qwen2.5-vl-3b also the tensor-parallel
path at size 1 with NCCL against the plain path, tokens and TPOT; epd_bench/gpu_check_engine.py), epd-1enc and
aggregated (one system at a time on the GPU under WORKLOADS, `make bench`'s scaled for a GPU, with GPU memory per process
sampled); then quantized weights (epd_bench/gpu_check_quant.py: Qwen2.5-VL-3B's build as FP8 and AWQ kept against
dequantized, MoE experts eager against grouped_mm), each step started only with its MIN_LEFT_S of the budget left;
then, with EXTRA_MIN_S of the budget left, the feature benchmarks (FEATURES) on the `bench` model.
--size small is the CPU dry run (tests/bench/test_gpu_check.py): tiny shapes with real vocabularies, a few requests,
a short test selection. Its work is fixed, so its --budget (1800 s) only stops a hang: no step is limited or skipped.

Estimated on one H200 (16 host cores): env 5 s, tests 45-75 s, per family a build of 15-40 s (a cached one 5 s),
the engine 35-75 s (5-15 s of it speculative decoding and chunked prefill), each system 50-75 s to start and load;
the feature benchmarks 40-80 s: 410-515 s in all, inside the 540 s budget (the features are skipped if time runs
short). The CPU dry run took 75 s on 2 idle cores, over 500 s at load average 4-15.
Writes DIR/gpu_check.json, DIR/gpu_check.md (tables ready to paste, each with the command that made it) and
DIR/logs.tar.gz (every log and epd-bench result: a GPU lease returns at most 8 files); --write-benchmarks also
replaces the marked gpu-check section of that Markdown file with the same report.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from epd_bench.gpu_check_engine import LIMIT_S as ENGINE_LIMIT_S
from epd_bench.gpu_check_engine import run_engine
from epd_bench.gpu_check_quant import FAMILY as QUANT_FAMILY
from epd_bench.gpu_check_quant import run_quant
from epd_bench.gpu_check_report import finish, has_section
from epd_bench.gpu_check_run import GpuSampler, Run, junit_counts, nvidia_smi, run_logged
from epd_bench.loads import Workload, epd_bench_cmd
from epd_bench.micro import parser
from epd_bench.stacks import Running, SystemSpec, aggregated, epd

TESTS = ("tests/models/test_parity.py", "tests/models/test_device.py", "tests/models/test_deepstack.py",
         "tests/models/test_prefix_parity.py", "tests/decoder_service/test_cuda_graphs.py",  # CUDA = CPU tokens
         "tests/models/test_lora_parity.py::test_each_adapter_gives_the_merged_models_tokens_in_a_batch_mixing_adapters",
         "tests/decoder_service/test_handoff.py::test_a_handed_off_request_continues_token_for_token")  # E -> P -> D
SMALL_TESTS = ("tests/models/test_device.py", "-k", "resolve_device or paged_cache")
PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "fastapi", "starlette", "uvicorn", "pydantic",
           "pydantic_core", "msgspec", "pyzmq", "regex", "typing_extensions")
FAMILIES = ("llava-1.5-7b", "qwen2.5-vl-3b")  # epd_builders/full_size.py presets, built and served in this order
# 32 x 4096 positions of K/V: 64 GiB for LLaVA-7B (512 KiB a token), 4.5 GiB for Qwen2.5-VL-3B, beside LLaVA's 12.6 GiB
# of LM weights and its encoder on one H200; 512 prompt tokens a step prefill an image prompt in 2 steps, not 19.
DECODER_FLAGS = ("--max-model-len", "4096", "--max-num-seqs", "32", "--max-prefill-tokens", "512")


def _workload(name: str, title: str, num_prompts: int, seed: int, images: int, output_len: int, *load: str,
              warmups: int = 2, repeat: float = 0.0) -> Workload:
    flags = ("--images-per-request", str(images), "--repeat-ratio", str(repeat), "--random-input-len", "32",
             "--random-output-len", str(output_len), "--num-warmups", str(warmups), "--request-timeout", "120", *load)
    return Workload(name, title, flags, num_prompts, seed)


# `make bench`'s workloads (epd_bench/compare.py: 2 requests/s, 1 image at a time, 16 text streams) scaled for a GPU
WORKLOADS = (
    _workload("repeat50", "1 image per request, 50 % of images repeated, Poisson arrivals at 8 requests/s", 96, 1,
              1, 32, "--request-rate", "8", warmups=4, repeat=0.5),
    _workload("images4", "4 new images per request, 4 in flight", 16, 2, 4, 16, "--max-concurrency", "4"),
    _workload("text", "text only, 32 in flight", 96, 3, 0, 64, "--max-concurrency", "32", warmups=4),
)
SMALL_WORKLOADS = (  # a few requests of 4 tokens each
    _workload("repeat50", "1 image per request, 50 % of images repeated, 2 in flight", 4, 1, 1, 4,
              "--max-concurrency", "2", warmups=1, repeat=0.5),
    _workload("images4", "4 new images per request, 2 in flight", 2, 2, 4, 4, "--max-concurrency", "2", warmups=0),
    _workload("text", "text only, 2 in flight", 4, 3, 0, 4, "--max-concurrency", "2", warmups=1),
)
ENV_SCRIPT = """import json, platform, torch, transformers
cuda = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cuda_available": cuda, "gpu_count": torch.cuda.device_count(),
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
    "transformers_from": transformers.__file__}))"""
LIMITS = {"tests": 150.0, "build": 180.0, "engine": ENGINE_LIMIT_S, "start": 180.0, "bench": 150.0, "feature": 240.0}  # seconds, one step
EXTRA_MIN_S = 60.0  # the feature benchmarks start only with this much of the budget left (--size full)
BUDGET_S = {"full": 540.0, "small": 1800.0}  # --budget's default per --size (small: a hang guard only, Run.guard_only)
# (step, module, its arguments, more for the small run); the bench model's directory goes to --model when TAKES_MODEL
FEATURES = (  # structured: no large-vocabulary estimate (it models a CPU mask at 32k, and trains a tokenizer first)
    ("structured", "structured", ("--large-vocab", "0"), ("--streams", "2", "--max-tokens", "4", "--rounds", "1")),
    ("n-prefill", "n_prefill", (), ("--image-tokens", "8", "--words", "4", "--repeats", "1")),
    ("encoder-batching", "encoder_batching", ("--device", "auto"), ("--rounds", "2", "--concurrency", "4")),
    ("lora-linears", "gpu_check_lora", ("--device", "auto"), ("--small", "--iters", "20")),
)
TAKES_MODEL = ("n-prefill", "encoder-batching")


def _last_json(text: str) -> Any:
    return json.loads(text.strip().splitlines()[-1])


def check_env(run: Run) -> None:
    with run.step("env") as rec:
        rec["packages"] = {name: _version(name) for name in PACKAGES}
        rec.update(_last_json(run.python(rec, "env.log", ["-c", ENV_SCRIPT], 120)))
        rec["gpus"] = [", ".join(row) for row in nvidia_smi("--query-gpu=name,driver_version,memory.total")]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "missing"


def run_tests(run: Run) -> None:
    with run.step("tests", "pytest.log") as rec:
        xml = run.work / "pytest.xml"
        selection = SMALL_TESTS if run.args.size == "small" else TESTS
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", *selection,
               "--device", run.args.device, f"--junitxml={xml}"]
        rec["command"] = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + shlex.join(["python", *cmd[1:-1]])
        # NOTE: no third-party pytest plugins but pytest-timeout (pyproject's `timeout` option is unknown without it,
        # an error under --strict-config): under `filterwarnings = error` a plugin that warns at import (anyio
        # 4.14's under pytest 9.2 does) stops the whole session
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        rec["exit_code"] = run_logged(cmd, run.work / "pytest.log", run.timeout(LIMITS["tests"]), env)
        if not xml.exists():
            raise RuntimeError(f"pytest exited {rec['exit_code']} before writing its report (work/pytest.log)")
        rec.update(junit_counts(xml))
        rec["ok"] = rec["exit_code"] == 0 and rec["failed"] == rec["errors"] == 0 and rec["passed"] > 0


def build_family(run: Run, family: str) -> Path | None:
    """The family's random checkpoint (epd_builders/full_size.py) at --size, drawn on --device."""
    with run.step(f"{family}/build", f"build-{family}.log") as rec:
        args = ["-m", "epd_builders.full_size", "--preset", family, "--size", run.args.size, "--device",
                run.args.device, "--json"]
        rec.update(_last_json(run.python(rec, f"build-{family}.log", args, LIMITS["build"])))
        return Path(rec["path"])
    return None


def serve(run: Run, family: str, spec: SystemSpec) -> None:
    """Start one system, run every workload against it, stop it."""
    logs = run.work / "logs" / family
    with run.step(f"{family}/{spec.name}", f"logs/{family}/{spec.name}-*.log", f"bench-{family}.log") as rec:
        rec["processes"] = {p.name: p.shell() for p in spec.procs}
        start_limit, started = run.timeout(LIMITS["start"]), time.monotonic()
        running, sampler = Running(spec, logs), GpuSampler()
        sampler.start()
        try:
            running.wait_healthy(start_limit)
            rec["startup_s"] = round(time.monotonic() - started, 1)
            rec["workloads"] = {w.name: bench(run, family, spec, w) for w in run_workloads(run)}
            done = {name: r.get("result", {}).get("completed") for name, r in rec["workloads"].items()}
            rec["ok"] = all(done[w.name] == w.num_prompts for w in run_workloads(run))
        finally:
            sampler.stop()
            names = {pid: name for name, pid in running.pids().items()}
            rec["gpu_mib"] = {names.get(pid, f"pid {pid}"): mib for pid, mib in sampler.peak_by_pid.items()}
            rec["gpu_used_peak_mib"], rec["gpu_sampler_error"] = sampler.peak_used_mib, sampler.error
            running.stop(grace=15)


def bench(run: Run, family: str, spec: SystemSpec, workload: Workload) -> dict[str, Any]:
    """One epd-bench run: its command, and its result or why there is none (the next workload still runs)."""
    results = run.work / "results" / family
    cmd = epd_bench_cmd(spec, workload, workload.num_prompts, workload.seed, results, f"{spec.name}-{workload.name}.json")
    out: dict[str, Any] = {"command": shlex.join(cmd)}
    try:
        code = run_logged(cmd, run.work / f"bench-{family}.log", run.timeout(LIMITS["bench"]))
    except TimeoutError as exc:
        return {**out, "error": str(exc)}
    if code != 0:
        return {**out, "error": f"epd-bench exited {code} (work/bench-{family}.log)"}
    result = json.loads((results / f"{spec.name}-{workload.name}.json").read_text())
    return {**out, "result": {k: v for k, v in result.items() if not isinstance(v, list)}}


def run_workloads(run: Run) -> tuple[Workload, ...]:
    return SMALL_WORKLOADS if run.args.size == "small" else WORKLOADS


def build_bench_model(run: Run) -> Path | None:
    """The feature benchmarks' model: the `bench` model, or a tiny LLaVA in the small run."""
    with run.step("bench-model", "bench-model.log") as rec:
        tiny = ["-c", "import sys; from epd_builders.tiny import TinySpec, build_tiny; "
                "print(build_tiny(TinySpec(family='llava'), sys.argv[1]))", str(run.scratch / "tiny-llava")]
        args = tiny if run.args.size == "small" else ["-m", "epd_builders.bench_model"]
        rec["model_dir"] = run.python(rec, "bench-model.log", args, LIMITS["build"]).strip().splitlines()[-1]
        return Path(rec["model_dir"])
    return None


def run_features(run: Run, model_dir: Path) -> None:
    """Each feature benchmark in a process of its own on the device (`--device auto` there, as the workers)."""
    env = {**os.environ, **dict(device_env(run.args.device))}
    for name, module, flags, small in FEATURES:
        if run.short_of(EXTRA_MIN_S):
            run.skip(name, f"{run.left():.0f} s of the budget left, fewer than {EXTRA_MIN_S:.0f}")
            continue
        with run.step(name, f"{name}.log") as rec:
            args = ["-m", f"epd_bench.{module}", "--json", *flags, *(small if run.args.size == "small" else ()),
                    *(("--model", str(model_dir)) if name in TAKES_MODEL else ())]
            text = run.python(rec, f"{name}.log", args, LIMITS["feature"], env)
            rec["result"] = json.loads(text[text.index("\n{") + 1:])  # the JSON after the command line


def device_env(device: str) -> tuple[tuple[str, str], ...]:
    """The environment that makes `--device auto` pick `device` (cuda: all GPUs visible, as they are)."""
    if device == "cuda":
        return ()
    return (("CUDA_VISIBLE_DEVICES", "" if device == "cpu" else device.split(":")[1]),)


def on_device(spec: SystemSpec, device: str) -> SystemSpec:
    """Workers run on --device auto: CUDA_VISIBLE_DEVICES makes that the device asked for."""
    if device == "cuda":
        return spec
    procs = tuple(replace(p, env=(*p.env, *device_env(device))) for p in spec.procs)
    return replace(spec, procs=procs)


def systems(model_dir: Path, device: str) -> tuple[SystemSpec, ...]:
    """EPD (1 encoder + 1 decoder) and the aggregated decoder, unpinned, on the device."""
    cores = len(os.sched_getaffinity(0))
    specs = (epd(model_dir, 1, cores, pin=False, decoder_flags=DECODER_FLAGS),
             aggregated(model_dir, cores, pin=False, decoder_flags=DECODER_FLAGS))
    return tuple(on_device(s, device) for s in specs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run(args)
    run.record["workloads"] = {w.name: {"title": w.title, "num_prompts": w.num_prompts} for w in run_workloads(run)}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # an outer `timeout`: stop the workers, write it up
    try:
        check_env(run)
        run_tests(run)
        built: dict[str, Path] = {}
        for family in FAMILIES:
            if (model_dir := build_family(run, family)) is not None:
                built[family] = model_dir
                run_engine(run, family, model_dir)
                for spec in systems(model_dir, args.device):
                    serve(run, family, spec)
        run_quant(run, built.get(QUANT_FAMILY))  # quant-fp8, quant-awq, quant-moe: epd_bench/gpu_check_quant.py
        if run.short_of(EXTRA_MIN_S):
            run.skip("bench-model", f"{run.left():.0f} s of the budget left, fewer than {EXTRA_MIN_S:.0f}")
        elif (bench_dir := build_bench_model(run)) is not None:
            run_features(run, bench_dir)
    finally:
        run.record["wall_s"] = round(time.monotonic() - run.started, 1)
        finish(run)
    sys.exit(0 if all(s["ok"] for s in run.record["steps"].values()) else 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("gpu_check", __doc__, json_help=None)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json, gpu_check.md, logs.tar.gz")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--size", choices=("full", "small"), default="full",
                   help="full: LLaVA-1.5-7B and Qwen2.5-VL-3B shapes and GPU workloads; small: the CPU dry run "
                        "(tiny shapes, a few requests, a short test selection) (default: %(default)s)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole run (default: {BUDGET_S['full']:.0f} for --size full, where each step "
                        "also has its own limit and the feature benchmarks are skipped when time runs short; "
                        f"{BUDGET_S['small']:.0f} for --size small, whose fixed steps all run to their end: there "
                        "the budget only stops a run that hangs)")
    p.add_argument("--write-benchmarks", type=Path, default=None, metavar="MD",
                   help="replace this Markdown file's <!-- gpu-check:begin --> ... <!-- gpu-check:end --> section "
                        "with the report (make gpu-check: docs/BENCHMARKS.md)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    if args.write_benchmarks is not None and not has_section(args.write_benchmarks):
        p.error(f"--write-benchmarks: {str(args.write_benchmarks)!r} has no gpu-check:begin ... end section")
    if args.budget is None:
        args.budget = BUDGET_S[args.size]
    args.argv = sys.argv[1:] if argv is None else argv
    return args


if __name__ == "__main__":
    main()
