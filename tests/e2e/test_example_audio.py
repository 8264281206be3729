"""The README's audio recipe against a running stack: a tiny Qwen2-Audio (built by the README's command) behind
`disagg-epd-proxy` (1 encoder, 1 decoder) answers `python -m proxy.example --audio`, with the tone made on the fly,
and counts the clip's tokens in its usage (tests/test_docs.py runs the README's blocks as written)."""
from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from proxy.example import audio_request
from tests.e2e.stack import ROOT, Stack, launched

pytestmark = pytest.mark.e2e
README_MODEL = "tiny-qwen2_audio"


def _run(args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("example-audio")
    model_dir = tmp / README_MODEL
    section = (ROOT / "README.md").read_text().split("### Audio inputs", 1)[1]
    build = re.search(r"\.venv/bin/python (-m epd_builders\.audio_tiny .*) --out", section)
    assert build is not None, "the README's Audio inputs section builds the tiny model"
    _run([*build.group(1).split(), "--out", str(model_dir)])
    with launched(tmp, "--model", str(model_dir), "--num-encoders", "1", "--num-decoders", "1") as s:
        yield s


def test_the_example_sends_a_made_tone_and_gets_an_answer(stack: Stack) -> None:
    out = _run(["-m", "proxy.example", "--audio", "--base-url", f"{stack.base_url}/v1", "--model", README_MODEL])
    usage = re.fullmatch(r"What do you hear\? -> '.*'  \(usage: .*prompt_tokens=(\d+).*\)\n", out, re.S)
    assert usage is not None, out
    question = audio_request(README_MODEL)
    question["messages"][0]["content"] = question["messages"][0]["content"][1:]  # the same question, no audio
    text_only = httpx.post(f"{stack.base_url}/v1/chat/completions", json=question, timeout=60).json()
    # a 2 s tone: 50 audio tokens, between the <|audio_bos|> and <|audio_eos|> the chat template writes
    assert int(usage.group(1)) == text_only["usage"]["prompt_tokens"] + 50 + 2
