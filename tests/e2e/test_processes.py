"""Process management: attach mode in front of separately started workers; SIGTERM leaves no orphans."""
from __future__ import annotations

import base64
import io
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import demo_png, health, launched, pid_alive, start, stop, wait_healthy
from tests.factories import make_image
from tests.ports import PortHolds

pytestmark = pytest.mark.e2e


def image_request(model: str) -> dict:
    buf = io.BytesIO()
    make_image(120, 80, "blue").save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is it?"}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}


def test_sigterm_to_launcher_stops_every_worker(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = str(tiny_model_dirs["qwen2_vl"])
    with launched(tmp_path, "--model", model, "--num-encoders", "2", "--num-decoders", "1") as stack:
        info = stack.info()
        pids = [stack.worker_pid(w["url"]) for w in info["encoders"] + info["decoders"]]
        resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=image_request("qwen2_vl"), timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] > 4
        assert all(pid_alive(p) for p in pids) and len(pids) == 3
        assert stop(stack.proc) == 0
    assert not any(pid_alive(p) for p in pids)


def test_attach_mode_serves_workers_started_elsewhere(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = str(tiny_model_dirs["llava"])
    holds = PortHolds()  # each port held for its process's life (it binds beside the hold)
    enc_port, dec_port, proxy_port = holds.take(), holds.take(), holds.take()
    procs = [
        start("encoder_service.cli", ["--model", model, "--port", str(enc_port)], tmp_path / "enc.log", held=True),
        start("decoder_service.cli", ["--model", model, "--port", str(dec_port)], tmp_path / "dec.log", held=True),
    ]
    try:
        enc, dec = f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{dec_port}"
        proxy = start("epd_launcher.cli", ["--port", str(proxy_port), "--served-model-name", "tiny-llava",
                                    "--encode-servers-urls", enc, "--decode-servers-urls", dec], tmp_path / "p.log",
                      held=True)
        procs.append(proxy)
        wait_healthy(f"http://127.0.0.1:{proxy_port}", proxy, tmp_path / "p.log")
        resp = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=image_request("tiny-llava"),
                          timeout=60)
        assert resp.status_code == 200
        assert resp.json()["usage"]["prompt_tokens"] > 256  # 256 LLaVA image tokens reached the decoder
        assert health(enc)["num_encoded"] == 1
    finally:
        for p in reversed(procs):
            stop(p)
        holds.close()


def test_sigterm_during_5_streams_lets_every_stream_finish(tmp_path: Path) -> None:
    """SIGTERM: the proxy stops accepting, the streams already running end normally, then everything exits."""
    started = threading.Barrier(6)  # 5 streams that have their first token + this thread

    def stream(base_url: str, seed: int) -> tuple[int, str | None, bool]:
        url = "data:image/png;base64," + base64.b64encode(demo_png("red", seed)).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color is it?"}]
        body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 48,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        tokens, finish, done, first = 0, None, False, True
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        finish = choice.get("finish_reason") or finish
                        if first and choice["delta"].get("content"):
                            first = False
                            started.wait(timeout=60)
        return tokens, finish, done

    with launched(tmp_path, "--num-encoders", "1", "--num-decoders", "1") as stack, \
            ThreadPoolExecutor(max_workers=5) as pool:
        futures = [pool.submit(stream, stack.base_url, 500 + i) for i in range(5)]
        started.wait(timeout=120)
        stack.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=120) for f in futures]
        assert stack.proc.wait(timeout=60) == 0
    assert results == [(48, "length", True)] * 5  # every stream ran to its end: nothing truncated
