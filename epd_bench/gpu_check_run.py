"""How `make gpu-check` runs its steps: the run's deadline and record, logged subprocesses, pytest's junit report,
nvidia-smi sampling."""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class Run:
    """The run's deadline, its work folder and everything recorded so far."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.started = args, time.monotonic()
        self.deadline = self.started + args.budget
        self.work = args.out / "work"  # packed into logs.tar.gz at the end
        self.work.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="epd-gpu-check-"))  # the small run's tiny model; removed at the end
        self.record: dict[str, Any] = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                                       "commit": git_revision(),
                                       "command": shlex.join(["python", "-m", "epd_bench.gpu_check", *args.argv]),
                                       "device": args.device, "size": args.size, "budget_s": args.budget,
                                       "workloads": {}, "steps": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def guard_only(self) -> bool:
        """The CPU dry run (--size small): its work is fixed and small, so its --budget only guards against a hang:
        no step is skipped for time and a step is stopped only when the whole budget is spent (a wall clock cannot
        tell a slow step on a busy machine from a stuck one). On a GPU (--size full) the budget is the lease's:
        each step has its own limit and the feature benchmarks are skipped when time runs short."""
        return bool(self.args.size == "small")

    def short_of(self, seconds: float) -> bool:
        """Whether an optional step should be skipped: fewer than `seconds` of the budget left (never in the dry
        run: see guard_only)."""
        return not self.guard_only and self.left() < seconds

    def timeout(self, limit: float) -> float:
        """A step's timeout: `limit` (its own; not in the dry run) within what is left of the budget."""
        if self.left() < 5:
            raise TimeoutError(f"out of time: the run's --budget of {self.args.budget:.0f} s is spent")
        return round(self.left() if self.guard_only else min(limit, self.left()), 1)

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

    def python(self, rec: dict[str, Any], log: str, args: list[str], limit: float,
               env: dict[str, str] | None = None) -> str:
        """`python ARGS` logged to work/LOG within the step's timeout (`limit`, see timeout), its command recorded in
        rec; the log's text. RuntimeError when it exits non-zero."""
        rec["command"] = shlex.join(["python", *args])
        if (code := run_logged([sys.executable, *args], self.work / log, self.timeout(limit), env)) != 0:
            raise RuntimeError(f"python {shlex.join(args[:2])} exited {code} (work/{log})")
        return (self.work / log).read_text()

    def skip(self, name: str, reason: str) -> None:
        """A step left out (it does not fail the run): recorded with its reason."""
        self.record["steps"][name] = {"ok": True, "skip_reason": reason, "seconds": 0.0}
        print(f"[{time.strftime('%H:%M:%S')}] {name}: skipped ({reason})", flush=True)


def git_revision() -> str:
    """The checkout's short commit, `+dirty` with uncommitted changes; "unknown" outside a git checkout.
    (--no-optional-locks: reading the status never rewrites the index.)"""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """cmd's output appended to log; killed with its whole process group past timeout (TimeoutError)."""
    log.parent.mkdir(parents=True, exist_ok=True)
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


def junit_counts(xml: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped, and each failing test with the first line of its message."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = next((child for child in case if child.tag in ("failure", "error")), None)
        if bad is None:
            counts["skipped" if case.find("skipped") is not None else "passed"] += 1
            continue
        counts["failed" if bad.tag == "failure" else "errors"] += 1
        first = (bad.get("message") or "").strip().splitlines()[:1]
        counts["failures"].append(f"{case.get('classname')}::{case.get('name')}: {' '.join(first)[:300]}")
    return counts
