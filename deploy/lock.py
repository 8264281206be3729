"""Pins every runtime dependency, with hashes, for the images: deploy/requirements/{proxy,worker-cpu,worker-cuda}.txt.

    python deploy/lock.py            (make lock; needs `uv` on PATH or in .venv/bin, and the package index)

Input: pyproject.toml's [project].dependencies and the IMAGE_EXTRAS optional ones. The proxy image takes those minus PROXY_EXCLUDES (no torch, no
transformers, no numpy: the proxy and scheduler import none of them, tests/test_torch_free.py and an import-linter
contract keep it so, and the image build and the smoke test run the proxy without them). The worker images take all of them, with torch pinned to TORCH_CPU or TORCH_CUDA.
Every lock also pins pip itself (the image build installs from the wheelhouse with it).

The target is the image, not this machine: CPython 3.11 on x86_64 glibc >= 2.28 (Debian bookworm). Each pin
carries the hashes of every file the index has for that version, so the same lock serves another machine's
wheelhouse; `pip install --require-hashes` refuses any file whose hash is not listed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "deploy" / "requirements"
PYTHON_VERSION, PLATFORM = "3.11", "x86_64-manylinux_2_28"
TORCH_CPU = "torch==2.13.0+cpu"  # https://download.pytorch.org/whl/cpu (here: /opt/wheels)
TORCH_CUDA = "torch==2.13.0"  # PyPI's Linux wheel: a CUDA build that brings its own CUDA libraries
PROXY_EXCLUDES = {"torch", "transformers", "tokenizers", "safetensors", "llguidance", "tqdm", "numpy", "compressed-tensors"}
PIP = "pip>=25"
# optional extras every image carries: `tracing` (--otlp-traces-endpoint; imported only when it is given)
IMAGE_EXTRAS = ("tracing",)
# where the CPU torch wheel is found: PyTorch's CPU index, or a folder of wheels (FIND_LINKS) on an offline host
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def dependency_name(spec: str) -> str:
    return re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower().replace("_", "-")


def inputs() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in IMAGE_EXTRAS for d in project["optional-dependencies"][extra]]
    others = [d for d in deps if dependency_name(d) != "torch"]
    return {
        "proxy": [d for d in others if dependency_name(d) not in PROXY_EXCLUDES] + [PIP],
        "worker-cpu": [TORCH_CPU, *others, PIP],
        "worker-cuda": [TORCH_CUDA, *others, PIP],
    }


def uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        sys.exit("deploy/lock.py needs uv: pip install uv")
    return found


def compile_lock(name: str, requirements: list[str]) -> None:
    src = OUT / f"{name}.in"
    src.write_text("# written by deploy/lock.py from pyproject.toml: edit that, then run `make lock`\n"
                   + "\n".join(requirements) + "\n")
    sources: list[str] = []
    if name == "worker-cpu":  # the CUDA lock must not see the CPU wheel: `==2.13.0` admits `2.13.0+cpu`
        sources = [f"--find-links={d}" for d in os.environ.get("FIND_LINKS", "/opt/wheels").split() if Path(d).is_dir()]
        sources = sources or [f"--extra-index-url={TORCH_CPU_INDEX}", "--index-strategy=unsafe-best-match"]
    cmd = [uv(), "pip", "compile", str(src.relative_to(ROOT)), "--generate-hashes", "--quiet",
           "--python-version", PYTHON_VERSION, "--python-platform", PLATFORM, "--no-emit-find-links",
           "--custom-compile-command", "make lock", "-o", str((OUT / f"{name}.txt").relative_to(ROOT)), *sources]
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"deploy/requirements/{name}.txt", flush=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, requirements in inputs().items():
        compile_lock(name, requirements)


if __name__ == "__main__":
    main()
