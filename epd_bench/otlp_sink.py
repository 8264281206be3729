"""`python -m epd_bench.otlp_sink --port P`: an OTLP/HTTP endpoint that answers every export 200 and keeps nothing.
`python -m epd_bench.proxy --tracing` points its traced proxies at it, so what is measured is the proxy's own cost of
tracing (spans made, batched, encoded and sent), not a collector's."""
from __future__ import annotations

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # the exporter keeps its connection

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._empty(200)

    def do_GET(self) -> None:  # noqa: N802 - /health, for the benchmark's readiness wait
        self._empty(200)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    ThreadingHTTPServer(("127.0.0.1", args.port), Sink).serve_forever()


if __name__ == "__main__":
    main()
