"""The README's aiperf / `vllm bench serve` recipe (Benchmarks, "With aiperf or `vllm bench serve`"): the requests
those tools send with its flags are ones the proxy takes, `min_tokens` is refused as it warns, its tokenizer line
names a folder a tokenizer loads from, and the image tokens it quotes for the demo model are the processor's."""
from __future__ import annotations

import base64
import io
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from epd_common.errors import APIError
from epd_models.resolve import resolve_model
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.factories import make_image
from tests.proxy.media_helpers import config

ROOT = Path(__file__).resolve().parent.parent


def recipe() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("### With aiperf or `vllm bench serve`", 1)[1].split("\n### ", 1)[0]


def tool_request(**extra: Any) -> dict[str, Any]:
    """What both tools send for one chat request (their OpenAI chat payload): text, one image, streamed usage."""
    buf = io.BytesIO()
    make_image(64, 64).save(buf, format="JPEG")
    image = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Shall I compare thee to a summer's day"},
        {"type": "image_url", "image_url": {"url": image}}]}],
        "max_completion_tokens": 16, "stream": True, "stream_options": {"include_usage": True}, **extra}


def test_the_recipes_requests_are_taken_with_ignore_eos_and_streamed_usage() -> None:
    assert all(flag in recipe() for flag in ("--extra-inputs ignore_eos:true", "--ignore-eos",
                                             "--use-server-token-count"))
    req = ChatCompletionRequest.model_validate(tool_request(ignore_eos=True))
    chat = prepare_chat(req, config())
    assert req.stream_options is not None and req.stream_options.include_usage
    assert chat.sampling.ignore_eos and chat.sampling.max_tokens == 16 and len(chat.items) == 1


def test_min_tokens_is_refused_as_the_recipe_warns() -> None:
    assert "min_tokens:N` gets a 400 `unsupported_parameter`" in recipe()
    with pytest.raises(APIError) as err:
        prepare_chat(ChatCompletionRequest.model_validate(tool_request(ignore_eos=True, min_tokens=16)), config())
    assert (err.value.status, err.value.code, err.value.param) == (400, "unsupported_parameter", "min_tokens")


def test_the_tokenizer_line_names_the_demo_checkpoint() -> None:
    found = re.search(r"TOKENIZER=\$\(\.venv/bin/python -c '(.+?)'\)", recipe())
    assert found is not None
    out = subprocess.run([sys.executable, "-c", found.group(1)], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert Path(out) == resolve_model("demo")
    assert AutoTokenizer.from_pretrained(out)("What color is the shape?").input_ids


def test_the_image_tokens_quoted_for_the_demo_are_the_processors_whatever_the_size() -> None:
    found = re.search(r"the demo model adds (\d+) per image,\s+whatever its size", recipe())
    assert found is not None
    processor = AutoProcessor.from_pretrained(resolve_model("demo"))
    text_only = len(processor.tokenizer("hi").input_ids)
    for size in ((64, 64), (640, 480)):
        with_image = processor(text="<image>hi", images=Image.new("RGB", size))["input_ids"][0]
        assert len(with_image) - text_only == int(found.group(1))
