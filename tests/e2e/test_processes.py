"""Process management: attach mode in front of separately started workers; SIGTERM leaves no orphans."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import pytest

from proxy.launcher import free_port
from tests.e2e.stack import health, launched, pid_alive, start, stop, wait_healthy
from tests.factories import make_image

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
        info = stack.get("/health").json()
        pids = [health(w["url"])["pid"] for w in info["encoders"] + info["decoders"]]
        resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=image_request("qwen2_vl"), timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] > 4
        assert all(pid_alive(p) for p in pids) and len(pids) == 3
        assert stop(stack.proc) == 0
    assert not any(pid_alive(p) for p in pids)


def test_attach_mode_serves_workers_started_elsewhere(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = str(tiny_model_dirs["llava"])
    enc_port, dec_port, proxy_port = free_port(), free_port(), free_port()
    procs = [
        start("encoder_service.server", ["--model", model, "--port", str(enc_port)], tmp_path / "enc.log"),
        start("decoder_service.server", ["--model", model, "--port", str(dec_port)], tmp_path / "dec.log"),
    ]
    try:
        enc, dec = f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{dec_port}"
        proxy = start("proxy.cli", ["--port", str(proxy_port), "--served-model-name", "tiny-llava",
                                    "--encode-servers-urls", enc, "--decode-servers-urls", dec], tmp_path / "p.log")
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
