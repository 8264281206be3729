"""The README's video recipe against a running stack: a tiny Qwen2-VL behind `disagg-epd-proxy` (1 encoder,
1 decoder) answers `python -m proxy.example --video` and the README's Python snippet (its URL and model name
pointed at this stack), with the clip made on the fly. One launcher: ~25 s on two cores."""
from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.example import video_request
from tests.e2e.stack import ROOT, Stack, launched

pytestmark = pytest.mark.e2e
FAMILY = "qwen2_vl"
README_URL, README_MODEL = "http://127.0.0.1:8000/v1", "tiny-qwen2_vl"


@pytest.fixture(scope="module")
def stack(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("example-video"), "--model", str(tiny_model_dirs[FAMILY]),
                  "--num-encoders", "1", "--num-decoders", "1") as s:
        yield s


def _run(args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _readme_video_snippet() -> str:
    """The Python block of the README's "Video inputs" section."""
    section = (ROOT / "README.md").read_text().split("### Video inputs", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def test_the_example_sends_a_made_clip_and_gets_an_answer(stack: Stack) -> None:
    out = _run(["-m", "proxy.example", "--video", "--base-url", f"{stack.base_url}/v1", "--model", FAMILY])
    usage = re.fullmatch(r"What happens in this video\? -> '.*'  \(usage: .*prompt_tokens=(\d+).*\)\n", out, re.S)
    assert usage is not None, out
    question = video_request(FAMILY)
    question["messages"][0]["content"] = question["messages"][0]["content"][1:]  # the same question, no video
    text_only = httpx.post(f"{stack.base_url}/v1/chat/completions", json=question, timeout=60).json()
    assert int(usage.group(1)) > text_only["usage"]["prompt_tokens"]  # the clip's tokens reached the model


def test_the_readme_video_snippet_runs_as_written(stack: Stack) -> None:
    snippet = _readme_video_snippet()
    assert README_URL in snippet and f'"{README_MODEL}"' in snippet
    code = snippet.replace(README_URL, f"{stack.base_url}/v1").replace(f'"{README_MODEL}"', f'"{FAMILY}"')
    out = _run(["-c", code])
    assert "prompt_tokens=" in out and "completion_tokens=" in out
