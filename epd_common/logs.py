"""Structured-enough logs: every line names the role and the request id in flight."""
from __future__ import annotations

import contextvars
import io
import logging
import sys

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def setup_logging(role: str, level: str = "INFO") -> None:
    """Every record on stderr, one line each naming the role and the request; stdout goes out a line at a time too
    (a pipe, `make run | tee log`, would otherwise hold printed lines in its buffer)."""
    if isinstance(sys.stdout, io.TextIOWrapper):  # the interpreter's own (a test's capture may be another)
        sys.stdout.reconfigure(line_buffering=True)
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {role} [%(request_id)s] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker call is noise
