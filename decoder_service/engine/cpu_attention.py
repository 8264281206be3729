"""The CPU's decode attention read in place from the paged pool: a small C++ kernel (cpu_attention.cpp), the default
on the CPU (`--cpu-sdpa-attention` keeps the gather + SDPA path of decoder_service/engine/paged_attention.py).

Why a kernel: torch has no paged attention on the CPU (`varlen_attn` raises there), so the fallback gathers every
decode row's blocks into a workspace each layer and runs SDPA over the copy, padded to the group's longest row: the
K/V is read three times (gather in, gather out, SDPA) where vLLM's CPU kernels read it once. The kernel reads each
row's own positions of its own blocks once (docs/BENCHMARKS.md, "Attention over blocks").

It is built by one call of the C++ compiler against torch's headers and libraries (`make install` and `make run`
build it) once per machine, torch version and source, into `$EPD_KERNEL_DIR` (default ~/.cache/epd/kernels), each
build in a folder of its own and moved into place whole: processes starting together never wait on a lock. Where it cannot be
built or loaded, the engine says why once and keeps the gather + SDPA path."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("epd.decoder")

NAME = "epd_cpu_attention"
SOURCE = Path(__file__).with_name("cpu_attention.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # built on the machine that runs it
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def kernel_dir() -> Path:
    return Path(os.environ.get("EPD_KERNEL_DIR") or Path.home() / ".cache" / "epd" / "kernels")


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def kernel_path() -> Path:
    """Where this source, these flags, this torch and this CPU's build lives."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, _cpu_flags()):
        h.update(part.encode())
    return kernel_dir() / f"{NAME}_{h.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    """One compiler call with the include and library paths torch's extension builder uses (cpp_extension.load's
    own build needs ninja and a lock file a killed process leaves behind); into a temporary file, then moved."""
    from torch.utils import cpp_extension

    path.parent.mkdir(parents=True, exist_ok=True)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    with tempfile.TemporaryDirectory(dir=path.parent, prefix="build-") as tmp:
        out = Path(tmp) / path.name
        cmd = [os.environ.get("CXX", "c++"), f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *(f"-isystem{d}" for d in includes), "-fPIC", "-std=c++20", *CFLAGS, "-shared", str(SOURCE),
               "-o", str(out), *(f"-L{d}" for d in cpp_extension.library_paths()),
               "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stderr.strip()[-400:]}")
        os.replace(out, path)


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(build: bool = True) -> ModuleType | None:
    """The kernel module (built first if it is not yet and `build`), or None where it cannot be had: said once."""
    with _lock:
        if NAME in _loaded:
            return _loaded[NAME]
        module: ModuleType | None = None
        try:
            path = kernel_path()
            if not path.exists() and build:
                t0 = time.monotonic()
                _build(path)
                logger.info("built the CPU decode attention kernel in %.0f s: %s", time.monotonic() - t0, path)
            if path.exists():
                module = _import(path)
            else:
                logger.warning("the CPU decode attention kernel is not built (%s): decode gathers blocks for SDPA", path)
        except Exception as e:  # no compiler, a failed build or load: the gather + SDPA path still serves
            logger.warning("the CPU decode attention kernel is unavailable (%s: %s): decode attention gathers blocks "
                           "for SDPA", type(e).__name__, str(e).strip()[-300:])
        _loaded[NAME] = module
        return module


def wanted(sdpa: bool, device: torch.device) -> bool:
    """Whether an engine on `device` reads decode attention through the kernel: on the CPU unless --cpu-sdpa-attention."""
    return device.type == "cpu" and not sdpa


if __name__ == "__main__":  # `make install`: build it now, so no decoder pays for it at start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"CPU decode attention kernel: {'ready' if load() is not None else 'unavailable'} ({kernel_path()})")
