"""A worker without a model, for the launcher's port tests: it waits until the file named by --go exists (the
test's signal), then serves GET /health -> {"pid": ...} through epd_common.cli.run_worker, as the encoder and the
decoder do (so it binds its port the way they do, EPD_REUSE_PORT included)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from epd_common.cli import run_worker
from tests.waiting import wait_for


@dataclass(frozen=True)
class FakeConfig:
    host: str
    port: int
    log_level: str = "warning"


def create_app(cfg: FakeConfig) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, int]:
        return {"pid": os.getpid()}

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--go"):
        p.add_argument(flag, required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    # the test holds the worker here, between the launcher's pick and the bind; a test that never lets it go (it
    # failed, or hung) leaves no worker behind waiting forever
    wait_for(Path(args.go).exists, f"the test's --go file {args.go}", interval=0.02)
    run_worker("fake", FakeConfig(args.host, args.port), create_app, [])


if __name__ == "__main__":
    main()
