"""End to end through `disagg-epd-proxy` (2 encoders, 1 decoder, demo model) with the official OpenAI client."""
from __future__ import annotations

import base64
import io
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, OpenAI
from safetensors import safe_open

from epd_builders.shapes import draw_shape
from epd_models.demo import find_demo_model
from tests.deploy.monitoring import dashboard_metrics, exported_names
from tests.e2e.stack import ROOT, Stack, health, launched, metric, urls_of
from tests.openai_schema import assert_valid

pytestmark = pytest.mark.e2e
MAX_IMAGES = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("e2e"), "--model", "demo", "--num-encoders", "2", "--num-decoders", "1",
                  "--max-images-per-request", str(MAX_IMAGES)) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(color: str, shape: str = "circle", seed: int = 0) -> str:
    import random

    buf = io.BytesIO()
    draw_shape(color, shape, random.Random(seed)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(*urls: str, question: str = "What color is the shape?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def encoders_encoded(stack: Stack) -> float:
    urls = urls_of(stack, "encoders")
    return sum(metric(httpx.get(f"{u}/metrics").text, "epd_encoder_items_encoded_total") for u in urls)


def test_red_circle_answer_names_the_colour(client: OpenAI) -> None:
    resp = client.chat.completions.create(model="demo", messages=user(data_url("red")), temperature=0, max_tokens=8)
    assert "red" in (resp.choices[0].message.content or "").lower()
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.prompt_tokens > 64  # 64 image tokens are counted
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert_valid("CreateChatCompletionResponse", resp.model_dump(exclude_unset=True))


def test_the_readme_python_example_runs_as_written(stack: Stack) -> None:
    block = (ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    code = block.replace("http://127.0.0.1:8000/v1", f"{stack.base_url}/v1")
    assert code != block  # only the server's address is changed
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "red" and "completion_tokens" in run.stdout


def test_streaming_gives_the_same_answer_in_chunks(client: OpenAI) -> None:
    messages = user(data_url("blue", "square", seed=3))
    whole = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=8)
    chunks = list(client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        assert_valid("CreateChatCompletionStreamResponse", c.model_dump(exclude_unset=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and "blue" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_presence_penalty_reaches_the_decoder(client: OpenAI) -> None:
    def answer(**penalty: float) -> str:
        resp = client.chat.completions.create(model="demo", messages=user(data_url("green")), temperature=0,
                                              max_tokens=6, extra_body={"ignore_eos": True}, **penalty)
        assert resp.usage is not None and resp.usage.completion_tokens == 6
        return resp.choices[0].message.content or ""

    plain, penalized = answer(), answer(presence_penalty=2.0)
    assert plain.startswith("green") and penalized.startswith("green")  # the first token is never penalized
    assert penalized != plain  # later tokens already generated are pushed down


def test_same_image_sent_again_is_not_re_encoded(client: OpenAI, stack: Stack) -> None:
    url = data_url("green", "triangle", seed=11)
    client.chat.completions.create(model="demo", messages=user(url), temperature=0, max_tokens=4)
    before = encoders_encoded(stack)
    again = client.chat.completions.create(model="demo", messages=user(url), temperature=0, max_tokens=4)
    assert encoders_encoded(stack) == before
    assert "green" in (again.choices[0].message.content or "")
    proxy_metrics = stack.get("/metrics").text
    assert metric(proxy_metrics, "epd_proxy_items_skipped_cached_total") >= 1
    client.chat.completions.create(model="demo", messages=user(data_url("green", seed=12)), max_tokens=2)
    assert encoders_encoded(stack) == before + 1


def test_images_of_one_request_are_encoded_on_both_encoders(client: OpenAI, stack: Stack) -> None:
    urls = [data_url("yellow", seed=20 + i) for i in range(4)]
    per_encoder = [metric(httpx.get(f"{u}/metrics").text, "epd_encoder_items_encoded_total")
                   for u in urls_of(stack, "encoders")]
    client.chat.completions.create(model="demo", messages=user(*urls), max_tokens=2)
    after = [metric(httpx.get(f"{u}/metrics").text, "epd_encoder_items_encoded_total")
             for u in urls_of(stack, "encoders")]
    grew = [a - b for a, b in zip(after, per_encoder, strict=True)]
    # each image to its rendezvous home unless that encoder is at the load bound, ceil(1.25 (m + 1) / 2) with m
    # placed: at most 3 of the 4 on one encoder, so both encode some
    assert sum(grew) == 4 and min(grew) >= 1, grew


def test_each_process_holds_only_its_half(stack: Stack) -> None:
    model_dir = find_demo_model()
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        numel = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}
    vision = sum(n for k, n in numel.items() if k.startswith(("vision_tower.", "multi_modal_projector.")))
    for url in urls_of(stack, "encoders"):
        loaded = health(url)["loaded"]
        assert loaded == {"modules": ["multi_modal_projector", "vision_tower"], "num_parameters": vision}
    for url in urls_of(stack, "decoders"):
        loaded = health(url)["loaded"]
        assert loaded == {"modules": ["language_model", "lm_head"], "num_parameters": sum(numel.values()) - vision}


def truncated_png() -> str:
    """A PNG whose header is fine (the proxy's check passes) but whose pixels are cut off (the encoder fails)."""
    url = data_url("orange", seed=99)
    raw = base64.b64decode(url.split(",", 1)[1])
    return "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()


@pytest.mark.parametrize("url,code", [
    ("data:image/png;base64,%%%", "invalid_image_url"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a but not really an image").decode(), "invalid_image"),
    (truncated_png(), "invalid_image"),
], ids=["malformed_data_url", "non_image_bytes", "truncated_png"])
def test_bad_image_is_400_and_next_request_succeeds(client: OpenAI, stack: Stack, url: str, code: str) -> None:
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=user(url), max_tokens=2)
    body = err.value.response.json()
    assert_valid("ErrorResponse", body)
    assert body["error"]["code"] == code
    ok = client.chat.completions.create(model="demo", messages=user(data_url("red")), temperature=0, max_tokens=8)
    assert "red" in (ok.choices[0].message.content or "")


def test_more_images_than_the_maximum_is_400(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=user(*[data_url("red")] * (MAX_IMAGES + 1)))
    assert err.value.response.json()["error"]["code"] == "too_many_images"
    ok = client.chat.completions.create(model="demo", messages=user(data_url("purple")), temperature=0, max_tokens=8)
    assert "purple" in (ok.choices[0].message.content or "")


def test_schema_violation_is_openai_error_not_fastapi_detail(stack: Stack) -> None:
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json={"model": "demo"}, timeout=30)
    assert resp.status_code == 400 and "detail" not in resp.json()
    assert_valid("ErrorResponse", resp.json())
    assert resp.json()["error"]["param"] == "messages"


def test_models_endpoint_lists_the_served_model(client: OpenAI, stack: Stack) -> None:
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert_valid("ListModelsResponse", stack.get("/v1/models").json())


def test_request_id_is_returned(stack: Stack) -> None:
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", headers={"X-Request-Id": "test-rid-1"},
                      json={"model": "demo", "messages": user(data_url("red", seed=77)), "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "test-rid-1"
    assert json.loads(resp.text)["object"] == "chat.completion"
    # the proxy passed the id on: the encoder's log line for this image carries it
    assert any(" encoder [test-rid-1] " in line for line in Path(stack.log).read_text().splitlines())


def test_log_has_no_tracebacks(stack: Stack) -> None:
    assert "Traceback" not in Path(stack.log).read_text()


def test_concurrent_streams_all_complete_with_their_own_answer(client: OpenAI) -> None:
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]

    def ask(i: int) -> str:
        stream = client.chat.completions.create(model="demo", messages=user(data_url(colors[i], seed=40 + i)),
                                                temperature=0, max_tokens=8, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(max_workers=len(colors)) as pool:
        answers = list(pool.map(ask, range(len(colors))))
    assert answers == colors


def test_same_seed_same_sample(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(model="demo", messages=user(data_url("white", seed=5)),
                                              temperature=1.5, seed=seed, max_tokens=12,
                                              extra_body={"ignore_eos": True})
        return resp.choices[0].message.content or ""

    first = sample(1)
    assert sample(1) == first and len({first, sample(2), sample(3), sample(4)}) > 1


METRICS = {  # what the issue asks each service to export (Prometheus text format)
    "proxy": ["epd_proxy_requests_total", "epd_proxy_time_to_first_token_seconds_bucket",
              "epd_proxy_inter_token_latency_seconds_bucket", "epd_proxy_e2e_request_latency_seconds_bucket",
              "epd_proxy_items_skipped_cached_total", "epd_proxy_retries_total",
              'epd_proxy_failovers_total{role="encoder"}', 'epd_proxy_failovers_total{role="decoder"}',
              "epd_proxy_encoder_items_outstanding", 'epd_proxy_workers_healthy{role="encoder"}'],
    "encoders": ["epd_encoder_queue_depth", "epd_encoder_items_encoded_total", "epd_ec_cache_hits", "epd_ec_cache_misses",
                 "epd_ec_cache_evictions", "epd_ec_cache_bytes", "epd_ec_producer_bytes_sent",
                 "epd_encoder_item_encode_seconds_bucket"],
    "decoders": ["epd_decoder_time_to_first_token_seconds_bucket", "epd_decoder_inter_token_latency_seconds_bucket",
                 "epd_decoder_e2e_request_latency_seconds_bucket", "epd_decoder_gather_seconds_bucket",
                 "epd_decoder_request_queue_time_seconds_bucket", "epd_decoder_gathered_bytes_bucket",
                 "epd_ec_consumer_bytes_received", "epd_ec_consumer_cache_hits", "epd_ec_consumer_cache_misses"],
}


def test_every_service_exports_the_operational_metrics(client: OpenAI, stack: Stack) -> None:
    before = stack.get("/metrics").text
    usage = client.chat.completions.create(model="demo", messages=user(data_url("red", seed=40)), max_tokens=3).usage
    texts = {"proxy": [stack.get("/metrics").text]}
    assert usage is not None
    for name, tokens in (("epd_proxy_prompt_tokens_total", usage.prompt_tokens),
                         ("epd_proxy_generation_tokens_total", usage.completion_tokens)):
        assert metric(texts["proxy"][0], name) - metric(before, name) == tokens  # what the client was told
    assert metric(texts["proxy"][0], "epd_proxy_requests_in_flight") == 0
    assert not [line for line in texts["proxy"][0].splitlines() if "_created" in line]  # counters: `_total` alone
    for role in ("encoders", "decoders"):
        texts[role] = [httpx.get(f"{u}/metrics", timeout=10).text for u in urls_of(stack, role)]
    for role, names in METRICS.items():
        for text in texts[role]:
            samples = {line.split(" ")[0].split("{")[0] for line in text.splitlines() if not line.startswith("#")}
            labelled = {line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}
            missing = [n for n in names if n not in samples and n not in labelled]
            assert not missing, f"{role} lacks {missing}"
    assert metric(texts["proxy"][0], 'epd_proxy_workers_healthy{role="encoder"}') == 2


def test_every_metric_the_dashboard_queries_is_exported_by_a_live_stack(client: OpenAI, stack: Stack) -> None:
    client.chat.completions.create(model="demo", messages=user(data_url("blue", seed=41)), max_tokens=3)
    texts = [stack.get("/metrics").text, *(httpx.get(f"{u}/metrics", timeout=10).text
                                          for role in ("encoders", "decoders") for u in urls_of(stack, role))]
    exported = {name for text in texts for name in exported_names(text)}
    queried = dashboard_metrics()
    assert len(queried) >= 20 and not queried - exported, sorted(queried - exported)
