"""Flags every worker takes."""
from __future__ import annotations

import argparse
from typing import Any


def worker_parser(prog: str, description: str, defaults: Any) -> argparse.ArgumentParser:
    """--model, --host, --port and --log-level, with defaults from the worker's config dataclass."""
    p = argparse.ArgumentParser(prog, description=description)
    p.add_argument("--model", default=defaults.model, help="'demo', a checkpoint directory, or a hub id")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--log-level", default=defaults.log_level)
    return p
