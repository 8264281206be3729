"""Launcher mode checks what it can before it spawns any worker: the tracing extra a flag needs, the model, each
decoder's K/V arithmetic, the proxy's and the workers' ports. Each failure is the whole of stderr: one line
`disagg-epd-proxy: error: …`, exit 2, no traceback, no worker started (the launcher logs every worker it starts)."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epd_common.startup import ConfigError
from epd_launcher import preflight
from epd_launcher.flags import parse_args

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "disagg-epd-proxy: error: "
# the launcher as its console script runs it, in an interpreter where `hide` cannot be imported (None in sys.modules
# is Python's own way to make an import fail with ImportError: what a venv without the extra gives)
LAUNCHER = """import sys
for name in sys.argv.pop(1).split(","):
    if name:
        sys.modules[name] = None
sys.argv[0] = "disagg-epd-proxy"
from epd_launcher.cli import main
main()
"""


def launch(*argv: str, hide: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return subprocess.run([sys.executable, "-c", LAUNCHER, hide, "--port", "0", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The message of the one line the launcher wrote, after checking it is the only one and the exit is 2."""
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), done.stderr[-3000:]  # no traceback, no "started ..."
    return lines[0].removeprefix(PREFIX)


def test_tracing_without_the_extra_is_refused_before_anything_loads() -> None:
    done = launch("--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces", hide="opentelemetry.sdk")
    message = one_error_line(done)
    assert message.startswith("--otlp-traces-endpoint needs the OpenTelemetry SDK") and "[tracing]" in message


def test_the_same_command_with_the_extra_passes_the_check() -> None:
    """The check is the import: with the SDK importable it does not refuse (nothing else is started here)."""
    from epd_common.tracing import require_sdk

    require_sdk()


@pytest.mark.parametrize("model,words", [
    ("/nonexistent/checkpoint", "is neither one of 'demo'"),
    ("tmp", "has no config.json: not a checkpoint directory"),
])
def test_a_model_that_cannot_be_had_is_refused(model: str, words: str, tmp_path: Path) -> None:
    message = one_error_line(launch("--model", str(tmp_path) if model == "tmp" else model))
    assert message.startswith("--model") and words in message


def test_a_max_model_len_the_kv_cache_memory_cannot_hold_is_refused_with_the_decoders_numbers() -> None:
    message = one_error_line(launch("--model", "demo", "--kv-cache-memory", "1MiB", "--max-model-len", "100000"))
    assert message.startswith("each decoder: --max-model-len 100000 needs")
    assert "--kv-cache-memory 1048576" in message and "the largest --max-model-len that fits is" in message


def _args(*argv: str) -> argparse.Namespace:
    return parse_args(list(argv))[1]


def test_the_kv_check_uses_the_decoders_arithmetic_and_passes_what_fits() -> None:
    """What the check refuses is what fits plus one (the decoder's own plan, read from the demo's config)."""
    demo = preflight.resolve("demo")
    with pytest.raises(ConfigError, match=r"the largest --max-model-len that fits is (\d+)") as refused:
        preflight.check_kv(_args("--kv-cache-memory", "1MiB", "--max-model-len", "100000"), demo)
    fits = int(str(refused.value).rsplit("fits is ", 1)[1].split(".")[0])
    preflight.check_kv(_args("--kv-cache-memory", "1MiB", "--max-model-len", str(fits)), demo)
    with pytest.raises(ConfigError):
        preflight.check_kv(_args("--kv-cache-memory", "1MiB", "--max-model-len", str(fits + 1)), demo)
    preflight.check_kv(_args("--max-model-len", "100000"), demo)  # no explicit pool: settled once loaded


def test_a_taken_proxy_port_is_refused() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = one_error_line(launch("--model", "demo", "--port", str(port)))
    assert message.startswith(f"cannot listen on 127.0.0.1:{port}")


def test_a_taken_worker_port_is_refused_before_any_worker_starts() -> None:
    with socket.socket() as busy:  # another program's listener on the second worker's port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        if not 1025 <= taken <= 65535 - 256:
            pytest.skip(f"the kernel's free port {taken} is outside --worker-base-port's range")
        message = one_error_line(launch("--model", "demo", "--num-encoders", "1", "--num-decoders", "1",
                                        "--worker-base-port", str(taken - 1)))
    assert f"port {taken} " in message or f"port {taken - 1} " in message  # the base itself may be anyone's too
    assert message.endswith("pick another --worker-base-port")
