"""The attach-mode proxy's start-up time and idle memory, against one real encoder and decoder (demo model).

    python -m epd_bench.proxy_startup [--runs 5] [--src DIR] [--proxy-module M] [--encoder-module M] [--decoder-module M]

Start-up: seconds from spawning the proxy to its first `GET /ready` 200 (the workers are already up, so this is
the proxy's own imports, app build and fleet sync). Idle RSS: VmRSS 2 s later, with no traffic. Also reports whether
libtorch is mapped into the process. `--src` and the module names measure another checkout (an older commit had
`proxy.cli`, `encoder_service.server`, `decoder_service.server`), so before/after are measured side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from epd_launcher.group import free_port

HOST = "127.0.0.1"


def _spawn(src: Path, module: str, args: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(src), EPD_INSECURE="1")
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=src, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        time.sleep(0.02)
    raise TimeoutError(f"{url} not ready in {timeout} s")


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(src: Path, proxy: str, encoder: str, decoder: str, runs: int) -> dict[str, Any]:
    enc_port, dec_port = free_port(), free_port()
    workers = [_spawn(src, encoder, ["--model", "demo", "--port", str(enc_port), "--ec-bind", f"tcp://{HOST}:0"]),
               _spawn(src, decoder, ["--model", "demo", "--port", str(dec_port)])]
    seconds, rss, torch_mapped = [], [], set()
    try:
        for proc, port in zip(workers, (enc_port, dec_port), strict=True):
            _wait(f"http://{HOST}:{port}/health", proc, 300)
        for _ in range(runs):
            port, start = free_port(), time.perf_counter()
            proc = _spawn(src, proxy, ["--host", HOST, "--port", str(port), "--log-level", "warning",
                                       "--encode-servers-urls", f"http://{HOST}:{enc_port}",
                                       "--decode-servers-urls", f"http://{HOST}:{dec_port}"])
            try:
                _wait(f"http://{HOST}:{port}/ready", proc, 120)
                seconds.append(time.perf_counter() - start)
                time.sleep(2)  # idle: what the proxy holds once started, not its start-up peak
                rss.append(_rss_mib(proc.pid))
                torch_mapped.add("libtorch" in Path(f"/proc/{proc.pid}/maps").read_text())
            finally:
                _stop(proc)
    finally:
        for proc in workers:
            _stop(proc)
    return {"proxy_module": proxy, "runs": runs, "startup_s_median": round(statistics.median(seconds), 2),
            "startup_s_min": round(min(seconds), 2), "startup_s_max": round(max(seconds), 2),
            "idle_rss_mib_median": round(statistics.median(rss)), "libtorch_mapped": any(torch_mapped)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser("python -m epd_bench.proxy_startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to measure")
    p.add_argument("--proxy-module", default="epd_launcher.cli")
    p.add_argument("--encoder-module", default="encoder_service.cli")
    p.add_argument("--decoder-module", default="decoder_service.cli")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.src.resolve(), args.proxy_module, args.encoder_module, args.decoder_module,
                             args.runs)))


if __name__ == "__main__":
    main()
