"""Lines go out as they are written when the launcher's output is a pipe (`make run | tee log`): its own printed
lines and its workers'. The launcher here is a script that sets up logging as disagg-epd-proxy does, prints a line
and spawns a worker (tests/launcher/chatty_worker.py) that prints one; neither flushes, and both keep running
until the test has read both lines from the pipe."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = """import sys
from epd_common.logs import setup_logging
from epd_launcher import group as group_module
from epd_launcher.group import WorkerGroup

setup_logging("proxy", "warning")
group_module.WORKER_MODULES["decoder"] = "tests.launcher.chatty_worker"
print("launcher up")  # no flush
group = WorkerGroup()
worker = group.spawn("decoder", "none", "127.0.0.1", 1, ["--go", sys.argv[1]])
worker.proc.wait()
group.stop()
"""
DEADLINE_S = 120.0  # a line that never comes fails the test here


def test_the_launchers_and_its_workers_lines_arrive_while_they_run(tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell has it
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(go)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True)
    reader.start()
    try:
        seen = {lines.get(timeout=DEADLINE_S).strip() for _ in range(2)}
        assert proc.poll() is None  # both arrived while the launcher and its worker still run
        assert "launcher up" in seen and any(line.startswith("worker ") for line in seen), seen
    finally:
        go.touch()
        proc.wait(timeout=DEADLINE_S)
        reader.join(timeout=DEADLINE_S)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0
