"""One command for a machine with a GPU: the parity and device tests there, then EPD against the aggregated decoder.

    python -m epd_bench.gpu_check --out DIR [--device cuda] [--smoke]      (make gpu-check)

Steps, each under its own timeout inside the whole run's deadline (--budget); a failed step is recorded and the
next one still runs:
  env          python, torch, CUDA and the versions of the packages that matter; the GPU (nvidia-smi)
  tests        tests/models/test_parity.py, test_device.py, test_deepstack.py and test_prefix_parity.py through
               pytest with --device
  model        the `bench` model (epd_builders/bench_model.py); --smoke: a tiny LLaVA
  structured, n-prefill
               the OpenAI-feature benchmarks on the device: constrained / free decoding at 16 streams
               (epd_bench/structured.py) and the prefill saved by n = 4 (epd_bench/n_prefill.py); --smoke: tiny sizes
  epd-1enc, aggregated
               one system at a time (epd_bench/stacks.py: 1 encoder + 1 decoder + proxy, then the aggregated
               decoder + proxy) on the device, one epd-bench run of the same workload against it, GPU memory per
               process sampled from nvidia-smi meanwhile, then stopped
Writes DIR/gpu_check.json, DIR/gpu_check.md (tables ready to paste, each with the command that made it) and
DIR/logs.tar.gz (every log and epd-bench result: a GPU lease returns at most 8 files). --smoke: a tiny model,
workload and test selection on the CPU (tests/bench/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from epd_bench.compare import Workload, epd_bench_cmd
from epd_bench.gpu_check_report import render_md
from epd_bench.stacks import Running, SystemSpec, aggregated, epd

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/models/test_parity.py", "tests/models/test_device.py", "tests/models/test_deepstack.py",
         "tests/models/test_prefix_parity.py")
SMOKE_TESTS = ("tests/models/test_device.py", "-k", "resolve_device or slot_cache")
PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "fastapi", "starlette", "uvicorn", "pydantic",
           "pydantic_core", "msgspec", "pyzmq", "regex", "typing_extensions")
WORKLOAD = Workload("gpu-check", "1 image per request, 50 % of images repeated, all at once, 16 in flight",
                    ("--images-per-request", "1", "--repeat-ratio", "0.5", "--request-rate", "inf",
                     "--max-concurrency", "16", "--random-input-len", "32", "--random-output-len", "32",
                     "--num-warmups", "4", "--request-timeout", "60"), 64, 1)
SMOKE_WORKLOAD = Workload("gpu-check-smoke", "as gpu-check, 4 requests of 4 tokens, 2 in flight",
                          ("--images-per-request", "1", "--repeat-ratio", "0.5", "--request-rate", "inf",
                           "--max-concurrency", "2", "--random-input-len", "8", "--random-output-len", "4",
                           "--num-warmups", "1", "--request-timeout", "60"), 4, 1)
ENV_SCRIPT = """import json, platform, torch, transformers
cuda = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cuda_available": cuda, "gpu_count": torch.cuda.device_count(),
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
    "transformers_from": transformers.__file__}))"""


@dataclass(frozen=True)
class Limits:  # seconds
    tests: float
    model: float
    start: float  # one system until every process answers /health
    bench: float  # one epd-bench run


LIMITS = Limits(tests=150, model=120, start=150, bench=120)
FEATURE_LIMIT_S = 240.0  # one feature benchmark
# (step, the benchmark's arguments, smoke arguments); the model directory is appended for n-prefill
FEATURES = (
    # no large-vocabulary estimate on the device: it models a CPU mask at 32k, and trains a tokenizer first
    ("structured", ("-m", "epd_bench.structured", "--json", "--large-vocab", "0"),
     ("-m", "epd_bench.structured", "--json", "--streams", "2", "--max-tokens", "4", "--rounds", "1",
      "--large-vocab", "0")),
    ("n-prefill", ("-m", "epd_bench.n_prefill", "--json", "--model"),
     ("-m", "epd_bench.n_prefill", "--json", "--image-tokens", "8", "--words", "4", "--repeats", "1", "--model")),
)


class Run:
    """The run's deadline, its work folder and everything recorded so far."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.started = args, time.monotonic()
        self.deadline = self.started + args.budget
        self.work = args.out / "work"  # packed into logs.tar.gz at the end
        self.work.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="epd-gpu-check-"))  # the smoke model; removed at the end
        self.workload = SMOKE_WORKLOAD if args.smoke else WORKLOAD
        self.record: dict[str, Any] = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                                       "command": shlex.join(["python", "-m", "epd_bench.gpu_check", *args.argv]),
                                       "device": args.device, "smoke": args.smoke,
                                       "workload": self.workload.title, "steps": {}}

    def timeout(self, limit: float) -> float:
        left = self.deadline - time.monotonic()
        if left < 5:
            raise TimeoutError(f"out of time: the run's --budget of {self.args.budget:.0f} s is spent")
        return round(min(limit, left), 1)

    @contextmanager
    def step(self, name: str, *logs: str) -> Iterator[dict[str, Any]]:
        """Records the step's time and outcome; an exception fails only this step. On failure the tails of the
        work folder's logs matching the globs `logs` are printed (the console is what a GPU lease shows first)."""
        rec: dict[str, Any] = self.record["steps"].setdefault(name, {})
        started = time.monotonic()
        print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
        try:
            yield rec
            rec.setdefault("ok", True)
        except Exception as exc:
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            rec["seconds"] = round(time.monotonic() - started, 1)
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {'ok' if rec.get('ok') else rec.get('error', 'failed')} "
                  f"({rec['seconds']} s)", flush=True)
            for log in [p for g in logs for p in sorted(self.work.glob(g))] if not rec.get("ok") else []:
                if tail := log.read_text(errors="replace")[-2000:].strip():
                    print(f"--- tail of {log.relative_to(self.work)}\n{tail}", flush=True)


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """cmd's output appended to log; killed with its whole process group past timeout (TimeoutError)."""
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{shlex.join(cmd[:4])} ... still running after {timeout:.0f} s: killed") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def nvidia_smi(*query: str) -> list[list[str]]:
    """Rows of `nvidia-smi --query-...=... --format=csv,noheader,nounits`; [] where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


class GpuSampler(threading.Thread):
    """Peak GPU memory (MiB) per process and in all, from nvidia-smi every `period` seconds until stop()."""

    def __init__(self, period: float = 1.0):
        super().__init__(daemon=True)
        self.period, self.done = period, threading.Event()
        self.peak_by_pid: dict[int, int] = {}
        self.peak_used_mib = 0
        self.error: str | None = None

    def run(self) -> None:
        while not self.done.is_set():
            try:
                for pid, mib in nvidia_smi("--query-compute-apps=pid,used_memory"):
                    self.peak_by_pid[int(pid)] = max(self.peak_by_pid.get(int(pid), 0), int(mib))
                for (used,) in nvidia_smi("--query-gpu=memory.used"):
                    self.peak_used_mib = max(self.peak_used_mib, int(used))
            except (subprocess.SubprocessError, ValueError, OSError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                return
            self.done.wait(self.period)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=15)


def check_env(run: Run) -> None:
    with run.step("env") as rec:
        rec["packages"] = {name: _version(name) for name in PACKAGES}
        out = subprocess.run([sys.executable, "-c", ENV_SCRIPT], capture_output=True, text=True,
                             timeout=run.timeout(120), check=True).stdout
        rec.update(json.loads(out.strip().splitlines()[-1]))
        rec["gpus"] = [", ".join(row) for row in nvidia_smi("--query-gpu=name,driver_version,memory.total")]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "missing"


def run_tests(run: Run) -> None:
    with run.step("tests", "pytest.log") as rec:
        xml = run.work / "pytest.xml"
        selection = SMOKE_TESTS if run.args.smoke else TESTS
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", *selection,
               "--device", run.args.device, f"--junitxml={xml}"]
        rec["command"] = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + shlex.join(["python", *cmd[1:-1]])
        # NOTE: no third-party pytest plugins but pytest-timeout (pyproject's `timeout` option is unknown without it,
        # an error under --strict-config): under `filterwarnings = error` a plugin that warns at import (anyio
        # 4.14's under pytest 9.2 does) stops the whole session
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        rec["exit_code"] = run_logged(cmd, run.work / "pytest.log", run.timeout(LIMITS.tests), env)
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


def build_model(run: Run) -> Path | None:
    with run.step("model", "model.log") as rec:
        tiny = ["-c", "import sys; from epd_builders.tiny import TinySpec, build_tiny; "
                "print(build_tiny(TinySpec(family='llava'), sys.argv[1]))", str(run.scratch / "tiny-llava")]
        cmd = [sys.executable, *(tiny if run.args.smoke else ["-m", "epd_builders.bench_model"])]
        log = run.work / "model.log"
        if run_logged(cmd, log, run.timeout(LIMITS.model)) != 0:
            raise RuntimeError(f"model build failed (work/{log.name})")
        rec["model_dir"] = log.read_text().strip().splitlines()[-1]
        return Path(rec["model_dir"])
    return None


def run_features(run: Run, model_dir: Path) -> None:
    """Each feature benchmark in a process of its own on the device (`--device auto` there, as the workers)."""
    env = {**os.environ, **dict(device_env(run.args.device))}
    for name, full, smoke in FEATURES:
        with run.step(name, f"{name}.log") as rec:
            args = [*(smoke if run.args.smoke else full), *([str(model_dir)] if name == "n-prefill" else [])]
            rec["command"] = shlex.join(["python", *args])
            log = run.work / f"{name}.log"
            if (code := run_logged([sys.executable, *args], log, run.timeout(FEATURE_LIMIT_S), env)) != 0:
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


def serve(run: Run, spec: SystemSpec) -> None:
    """Start one system, run the workload against it, stop it."""
    workload = run.workload
    with run.step(spec.name, f"logs/{spec.name}-*.log", "epd-bench.log") as rec:
        rec["processes"] = {p.name: p.shell() for p in spec.procs}
        start_limit, started = run.timeout(LIMITS.start), time.monotonic()
        running, sampler = Running(spec, run.work / "logs"), GpuSampler()
        sampler.start()
        try:
            running.wait_healthy(start_limit)
            rec["startup_s"] = round(time.monotonic() - started, 1)
            cmd = epd_bench_cmd(spec, workload, workload.num_prompts, workload.seed, run.work / "results",
                                f"{spec.name}.json")
            rec["bench_command"] = shlex.join(cmd)
            if (code := run_logged(cmd, run.work / "epd-bench.log", run.timeout(LIMITS.bench))) != 0:
                raise RuntimeError(f"epd-bench exited {code} (work/epd-bench.log)")
            result = json.loads((run.work / "results" / f"{spec.name}.json").read_text())
            rec["result"] = {k: v for k, v in result.items() if not isinstance(v, list)}
            rec["ok"] = result["completed"] == workload.num_prompts
        finally:
            sampler.stop()
            names = {pid: name for name, pid in running.pids().items()}
            rec["gpu_mib"] = {names.get(pid, f"pid {pid}"): mib for pid, mib in sampler.peak_by_pid.items()}
            rec["gpu_used_peak_mib"], rec["gpu_sampler_error"] = sampler.peak_used_mib, sampler.error
            running.stop(grace=15)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # an outer `timeout`: stop the workers, write it up
    try:
        check_env(run)
        run_tests(run)
        model_dir = build_model(run)
        if model_dir is not None:
            run_features(run, model_dir)
            cores = len(os.sched_getaffinity(0))
            for spec in (epd(model_dir, 1, cores, pin=False), aggregated(model_dir, cores, pin=False)):
                serve(run, on_device(spec, args.device))
    finally:
        run.record["wall_s"] = round(time.monotonic() - run.started, 1)
        finish(run)
    sys.exit(0 if all(s["ok"] for s in run.record["steps"].values()) else 1)


def finish(run: Run) -> None:
    """gpu_check.json, gpu_check.md, and the work folder packed into logs.tar.gz."""
    out = run.args.out
    (out / "gpu_check.json").write_text(json.dumps(run.record, indent=1))
    (out / "gpu_check.md").write_text(render_md(run.record))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(run.work, arcname="work")
    shutil.rmtree(run.work, ignore_errors=True)
    shutil.rmtree(run.scratch, ignore_errors=True)
    print(f"wrote {out}/gpu_check.json, gpu_check.md, logs.tar.gz in {run.record['wall_s']} s", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m epd_bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json, gpu_check.md, logs.tar.gz")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="a tiny model, workload and test selection (for CPU tests)")
    p.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run (default: %(default)s)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


if __name__ == "__main__":
    main()
