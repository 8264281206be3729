"""The attach-mode proxy's start-up time and idle memory, against one real encoder and decoder (demo model).

    python -m epd_bench.proxy_startup [--runs 5] [--src DIR] [--proxy-module M] [--encoder-module M] [--decoder-module M]

Start-up: seconds from spawning the proxy to its first `GET /ready` 200 (the workers are already up, so this is
the proxy's own imports, app build and fleet sync). Idle RSS: VmRSS 2 s later, with no traffic. Also reports whether
libtorch is mapped into the process. `--src` and the module names measure another checkout (an older commit had
`proxy.cli`, `encoder_service.server`, `decoder_service.server`), so before/after are measured side by side.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from epd_bench.micro import HOST, emit, parser, spawn, status_kib, stop, wait_http
from epd_launcher.group import free_port


def measure(src: Path, proxy: str, encoder: str, decoder: str, runs: int) -> dict[str, Any]:
    enc_port, dec_port = free_port(), free_port()
    env = {"EPD_INSECURE": "1"}
    workers = [spawn(["-m", encoder, "--model", "demo", "--port", str(enc_port), "--ec-bind", f"tcp://{HOST}:0"],
                     env, src, src), spawn(["-m", decoder, "--model", "demo", "--port", str(dec_port)], env, src, src)]
    seconds, rss, torch_mapped = [], [], set()
    try:
        for proc, port in zip(workers, (enc_port, dec_port), strict=True):
            wait_http(f"http://{HOST}:{port}/health", proc, 300)
        for _ in range(runs):
            port, start = free_port(), time.perf_counter()
            proc = spawn(["-m", proxy, "--host", HOST, "--port", str(port), "--log-level", "warning",
                          "--encode-servers-urls", f"http://{HOST}:{enc_port}",
                          "--decode-servers-urls", f"http://{HOST}:{dec_port}"], env, src, src)
            try:
                wait_http(f"http://{HOST}:{port}/ready", proc, 120)
                seconds.append(time.perf_counter() - start)
                time.sleep(2)  # idle: what the proxy holds once started, not its start-up peak
                rss.append(status_kib("VmRSS", proc.pid) / 1024)
                torch_mapped.add("libtorch" in Path(f"/proc/{proc.pid}/maps").read_text())
            finally:
                stop(proc)
    finally:
        for proc in workers:
            stop(proc)
    return {"proxy_module": proxy, "runs": runs, "startup_s_median": round(statistics.median(seconds), 2),
            "startup_s_min": round(min(seconds), 2), "startup_s_max": round(max(seconds), 2),
            "idle_rss_mib_median": round(statistics.median(rss)), "libtorch_mapped": any(torch_mapped)}


def main(argv: list[str] | None = None) -> None:
    p = parser("proxy_startup", __doc__, json_help=None)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout to measure")
    p.add_argument("--proxy-module", default="epd_launcher.cli")
    p.add_argument("--encoder-module", default="encoder_service.cli")
    p.add_argument("--decoder-module", default="decoder_service.cli")
    args = p.parse_args(argv)
    emit(measure(args.src.resolve(), args.proxy_module, args.encoder_module, args.decoder_module, args.runs), True)


if __name__ == "__main__":
    main()
