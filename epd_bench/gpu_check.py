"""One command for a machine with a GPU: the parity tests there, then EPD against the aggregated decoder at real sizes.

    python -m epd_bench.gpu_check --out DIR [--device cuda] [--size full|small] [--budget S] [--write-benchmarks MD]

    make gpu-check  =  --device cuda --out runs/gpu-check --write-benchmarks docs/BENCHMARKS.md

Steps, each under its own timeout inside the whole run's deadline (--budget, default 540 s: under 10 minutes on
one H200 with the estimates below); a failed step is recorded and the next one still runs:
  env          python, torch, CUDA and the versions of the packages that matter; the GPU (nvidia-smi)
  tests        tests/models/test_parity.py, test_device.py, test_deepstack.py and test_prefix_parity.py through
               pytest with --device (the families' split path against model.generate())
  then for LLaVA-1.5-7B and Qwen2.5-VL-3B, one after the other:
  <family>/build
               a random checkpoint of the real shapes, drawn on the device (epd_builders/full_size.py; cached, so
               a second run reuses it)
  <family>/engine
               the paged engine on that checkpoint (epd_bench/gpu_check_engine.py): its K/V plan at 0.9 utilization
               (sequences of 1,024 / 4,096 tokens held at once), decode CUDA graphs captured and replayed, TPOT at
               batch 1 over the HBM bound (weight bytes / the device's bandwidth), output tokens/s at 64 in flight
  <family>/epd-1enc, <family>/aggregated
               one system at a time on the one GPU (epd_bench/stacks.py: 1 encoder + 1 decoder + proxy, then the
               aggregated decoder + proxy), the `make bench` workloads scaled for a GPU against it (WORKLOADS),
               GPU memory per process sampled from nvidia-smi meanwhile, then stopped
  bench-model, structured, n-prefill
               if at least EXTRA_MIN_S of the budget is left (else recorded as skipped): the OpenAI-feature
               benchmarks on the device on the small `bench` model (epd_bench/structured.py, epd_bench/n_prefill.py)
--size small is the CPU dry run (tests/bench/test_gpu_check.py): the same steps with both families at tiny shapes
(real vocabularies and image geometry), workloads of a few requests, a short test selection, a tiny LLaVA for the
feature benchmarks. That work is fixed, so every step runs to its end whatever the machine's load: its --budget
(default 1800 s) only stops a run that hangs, and no step has a limit of its own or is skipped for time.

Estimated wall time on one H200 (16 host cores; not yet measured at these sizes); [the CPU dry run, measured on
2 cores: 75 s in all; 207 s (145 CPU s) beside other load (load average 3-5); over 500 s at load average 4-15]:
  env 5 s [3 s]; tests 45-75 s (test_parity.py and test_device.py take 47 s on the 2 cores here) [7 s, 2 tests]
  LLaVA-1.5-7B build 15-40 s: 7.06B bf16 parameters drawn on the GPU in about a second, then 13.2 GiB of
    safetensors copied to the host and written at 0.5-2 GB/s (safetensors writes 0.5 GB/s on this VM's disk);
    Qwen2.5-VL-3B 10-20 s (7.0 GiB); a cached build 5 s (python start-up, the file headers) [5 s each]
  engine 30-60 s per family, not yet measured (the LM loaded again, a profiling forward, 11 graph captures for
    buckets up to 64 rows, 2 x 34 decode steps) [10-25 s each]; the feature benchmarks are the first to be skipped
    when the budget runs short
  start-up of one system 20-30 s for LLaVA (the decoder reads 12.6 GiB of LM weights from the page cache and copies
    them to the GPU, the encoder 0.6 GiB, each process about 10 s of python, torch and CUDA start-up; before the
    language half was built on meta a 7B LM's random init alone took over a minute of one core), 15-20 s for Qwen
    [5-9 s]
  the three workloads 35-45 s per system (repeat50's 96 arrivals take 12 s; each epd-bench run starts in 2-3 s)
    [about 3 s]; so about 60-75 s per LLaVA system and 50-65 s per Qwen system [7-12 s]
  about 330-420 s up to the feature benchmarks, which take 40-80 s of what is left (skipped under EXTRA_MIN_S)
  [18 s]: 400-500 s in all, inside the 540 s budget and the 10 minutes asked for (`make gpu-check`'s `install`
  prerequisite not counted).
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
import shutil
import signal
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from epd_bench.compare import Workload, epd_bench_cmd
from epd_bench.gpu_check_report import BEGIN, END, render_md, write_section
from epd_bench.gpu_check_run import GpuSampler, Run, nvidia_smi, run_logged
from epd_bench.stacks import Running, SystemSpec, aggregated, epd

TESTS = ("tests/models/test_parity.py", "tests/models/test_device.py", "tests/models/test_deepstack.py",
         "tests/models/test_prefix_parity.py", "tests/decoder_service/test_cuda_graphs.py",  # CUDA = CPU tokens
         "tests/decoder_service/test_handoff.py::test_a_handed_off_request_continues_token_for_token")  # E -> P -> D
SMALL_TESTS = ("tests/models/test_device.py", "-k", "resolve_device or paged_cache")
PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "fastapi", "starlette", "uvicorn", "pydantic",
           "pydantic_core", "msgspec", "pyzmq", "regex", "typing_extensions")
FAMILIES = ("llava-1.5-7b", "qwen2.5-vl-3b")  # epd_builders/full_size.py presets, built and served in this order
# NOTE: KV slots are preallocated: 32 x 4096 positions is 64 GiB for LLaVA-7B (32 layers x 32 K/V heads x 128 x 2 x
# bf16 = 512 KiB a token) and 4.5 GiB for Qwen2.5-VL-3B (2 K/V heads); with LLaVA's 12.6 GiB of LM weights that fits
# one H200 beside its encoder, one system at a time. Qwen's own 128000 positions would not (144 GiB). 512 prompt
# tokens a step: an image prompt (576 + 32 tokens for LLaVA) prefills in 2 steps, not the CPU default's 19.
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
LIMITS = {"tests": 150.0, "build": 180.0, "engine": 150.0, "start": 180.0, "bench": 150.0, "feature": 240.0}  # seconds, one step
EXTRA_MIN_S = 60.0  # the feature benchmarks start only with this much of the budget left (--size full)
BUDGET_S = {"full": 540.0, "small": 1800.0}  # --budget's default per --size (small: a hang guard only, Run.guard_only)
# (step, the benchmark's arguments, small arguments); the model directory is appended for TAKES_MODEL
FEATURES = (
    # no large-vocabulary estimate on the device: it models a CPU mask at 32k, and trains a tokenizer first
    ("structured", ("-m", "epd_bench.structured", "--json", "--large-vocab", "0"),
     ("-m", "epd_bench.structured", "--json", "--streams", "2", "--max-tokens", "4", "--rounds", "1",
      "--large-vocab", "0")),
    ("n-prefill", ("-m", "epd_bench.n_prefill", "--json", "--model"),
     ("-m", "epd_bench.n_prefill", "--json", "--image-tokens", "8", "--words", "4", "--repeats", "1", "--model")),
    ("encoder-batching", ("-m", "epd_bench.encoder_batching", "--json", "--device", "auto", "--model"),
     ("-m", "epd_bench.encoder_batching", "--json", "--device", "auto", "--rounds", "2", "--concurrency", "4",
      "--model")),
)
TAKES_MODEL = ("n-prefill", "encoder-batching")  # their arguments end with --model: the bench model's directory


def check_env(run: Run) -> None:
    with run.step("env") as rec:
        rec["packages"] = {name: _version(name) for name in PACKAGES}
        cmd = [sys.executable, "-c", ENV_SCRIPT]
        if run_logged(cmd, run.work / "env.log", run.timeout(120)) != 0:
            raise RuntimeError("the environment probe failed (work/env.log)")
        rec.update(json.loads((run.work / "env.log").read_text().strip().splitlines()[-1]))
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


def junit_counts(xml: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped, and each failing test with the first line of its message."""
    cases = ET.parse(xml).getroot().iter("testcase")
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in cases:
        bad = next((child for child in case if child.tag in ("failure", "error")), None)
        if bad is None:
            counts["skipped" if case.find("skipped") is not None else "passed"] += 1
            continue
        counts["failed" if bad.tag == "failure" else "errors"] += 1
        first = (bad.get("message") or "").strip().splitlines()[:1]
        counts["failures"].append(f"{case.get('classname')}::{case.get('name')}: {' '.join(first)[:300]}")
    return counts


def build_family(run: Run, family: str) -> Path | None:
    """The family's random checkpoint (epd_builders/full_size.py) at --size, drawn on --device."""
    with run.step(f"{family}/build", f"build-{family}.log") as rec:
        args = ["-m", "epd_builders.full_size", "--preset", family, "--size", run.args.size, "--device",
                run.args.device, "--json"]
        rec["command"] = shlex.join(["python", *args])
        log = run.work / f"build-{family}.log"
        if (code := run_logged([sys.executable, *args], log, run.timeout(LIMITS["build"]))) != 0:
            raise RuntimeError(f"the build exited {code} (work/{log.name})")
        rec.update(json.loads(log.read_text().strip().splitlines()[-1]))
        return Path(rec["path"])
    return None


def run_engine(run: Run, family: str, model_dir: Path) -> None:
    """The paged engine on the family's checkpoint on the device (epd_bench/gpu_check_engine.py)."""
    with run.step(f"{family}/engine", f"engine-{family}.log") as rec:
        args = ["-m", "epd_bench.gpu_check_engine", "--model", str(model_dir), "--device", run.args.device, "--json",
                *(("--steps", "4") if run.args.size == "small" else ())]
        rec["command"] = shlex.join(["python", *args])
        log = run.work / f"engine-{family}.log"
        if (code := run_logged([sys.executable, *args], log, run.timeout(LIMITS["engine"]))) != 0:
            raise RuntimeError(f"the engine run exited {code} (work/{log.name})")
        rec["result"] = json.loads(log.read_text().strip().splitlines()[-1])
        if run.args.device.startswith("cuda") and not rec["result"]["graph_replays"]:
            raise RuntimeError("no decode step replayed a CUDA graph")


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
        log = run.work / "bench-model.log"
        if run_logged([sys.executable, *args], log, run.timeout(LIMITS["build"])) != 0:
            raise RuntimeError(f"model build failed (work/{log.name})")
        rec["model_dir"] = log.read_text().strip().splitlines()[-1]
        return Path(rec["model_dir"])
    return None


def run_features(run: Run, model_dir: Path) -> None:
    """Each feature benchmark in a process of its own on the device (`--device auto` there, as the workers)."""
    env = {**os.environ, **dict(device_env(run.args.device))}
    for name, full, small in FEATURES:
        if run.short_of(EXTRA_MIN_S):
            run.skip(name, f"{run.left():.0f} s of the budget left, fewer than {EXTRA_MIN_S:.0f}")
            continue
        with run.step(name, f"{name}.log") as rec:
            args = [*(small if run.args.size == "small" else full), *([str(model_dir)] if name in TAKES_MODEL else [])]
            rec["command"] = shlex.join(["python", *args])
            log = run.work / f"{name}.log"
            if (code := run_logged([sys.executable, *args], log, run.timeout(LIMITS["feature"]), env)) != 0:
                raise RuntimeError(f"{name} exited {code} (work/{log.name})")
            text = log.read_text()
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
        for family in FAMILIES:
            if (model_dir := build_family(run, family)) is not None:
                run_engine(run, family, model_dir)
                for spec in systems(model_dir, args.device):
                    serve(run, family, spec)
        if run.short_of(EXTRA_MIN_S):
            run.skip("bench-model", f"{run.left():.0f} s of the budget left, fewer than {EXTRA_MIN_S:.0f}")
        elif (bench_dir := build_bench_model(run)) is not None:
            run_features(run, bench_dir)
    finally:
        run.record["wall_s"] = round(time.monotonic() - run.started, 1)
        finish(run)
    sys.exit(0 if all(s["ok"] for s in run.record["steps"].values()) else 1)


def finish(run: Run) -> None:
    """gpu_check.json, gpu_check.md, logs.tar.gz; and the marked section of --write-benchmarks."""
    out = run.args.out
    (out / "gpu_check.json").write_text(json.dumps(run.record, indent=1))
    (out / "gpu_check.md").write_text(render_md(run.record))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(run.work, arcname="work")
    shutil.rmtree(run.work, ignore_errors=True)
    shutil.rmtree(run.scratch, ignore_errors=True)
    print(f"wrote {out}/gpu_check.json, gpu_check.md, logs.tar.gz in {run.record['wall_s']} s", flush=True)
    if run.args.write_benchmarks is not None:
        write_section(run.args.write_benchmarks, run.record)
        print(f"replaced the gpu-check section of {run.args.write_benchmarks}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    if args.write_benchmarks is not None and not _has_section(args.write_benchmarks):
        p.error(f"--write-benchmarks: {str(args.write_benchmarks)!r} has no {BEGIN} ... {END} section")
    if args.budget is None:
        args.budget = BUDGET_S[args.size]
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def _has_section(docs: Path) -> bool:
    text = docs.read_text() if docs.is_file() else ""
    return BEGIN in text and END in text


if __name__ == "__main__":
    main()
