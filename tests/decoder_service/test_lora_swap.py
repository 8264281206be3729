"""Adapters beyond --max-loras (epd_models/lora/layers.py `LoRASet`): up to --max-cpu-loras are known (host memory),
--max-loras of them resident in the linears; a request for one that is not resident evicts the least recently used
adapter no request holds, and gives exactly the answer it gives resident from the start; while every resident one
is in use it waits (AdaptersBusy, woken by a release) and answers once one frees, and the streams already running
are unchanged."""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from decoder_service.config import DecoderConfig
from decoder_service.generate import generate
from decoder_service.lora import attach_loras
from decoder_service.server import create_app
from epd_common.lora_flags import LoRAModule
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.lora.layers import AdaptersBusy
from tests.lora_adapters import make_adapter
from tests.models.test_parity import NUM_NEW, _argmax, _prompt

NAMES = ("a", "b", "c")
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-swap")
    return {n: make_adapter(tiny_model_dirs["llava"], root / n, seed=10 + i, rank=8) for i, n in enumerate(NAMES)}


def config(adapters: dict[str, Path], max_loras: int, **extra: Any) -> DecoderConfig:
    return DecoderConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=len(adapters), cpu_exact_linear=True,
                         lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()), **extra)


def test_one_resident_slot_swaps_adapters_in_least_recently_used_order(tiny_model_dirs: dict[str, Path],
                                                                       adapters: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["llava"]
    lm = LanguageHalf(model_dir)
    prompt = _prompt(lm, VisionHalf(model_dir), model_dir, "one_image")[0]
    lora = attach_loras(lm, config(adapters, max_loras=1))
    assert lora is not None
    assert [(d["name"], d["resident"]) for d in lora.describe()] == [("a", True), ("b", False), ("c", False)]

    def tokens(name: str) -> list[int]:
        slot = lora.acquire(name)
        try:
            return list(generate(lm, replace(prompt, lora=slot), _argmax, NUM_NEW, set()))
        finally:
            lora.release(slot)

    first = {n: tokens(n) for n in NAMES}  # a resident, then b evicts a, then c evicts b
    assert lora.evictions == 2 and list(lora.slots) == ["c"]
    assert len({tuple(t) for t in first.values()}) == 3
    assert {n: tokens(n) for n in ("b", "a", "c")} == first  # swapped back in: the same answers
    together = attach_loras(LanguageHalf(model_dir), config(adapters, max_loras=3))
    assert together is not None and not together.evictions
    held = lora.acquire("c")  # c in use: b cannot evict it
    with pytest.raises(AdaptersBusy) as busy:
        lora.acquire("b")
    assert not busy.value.freed.done()
    lora.release(held)
    assert busy.value.freed.done()  # woken by the release
    lora.release(lora.acquire("b"))
    assert list(lora.slots) == ["b"] and not lora.users


@pytest.fixture
def client(tiny_model_dirs: dict[str, Path], adapters: dict[str, Path]) -> Iterator[TestClient]:
    cfg = config(adapters, max_loras=1, max_num_seqs=4, max_model_len=512, internal_key="k")
    with TestClient(create_app(cfg, lm=LanguageHalf(tiny_model_dirs["llava"]))) as c:
        yield c


def answer(client: TestClient, lora: str) -> str:
    body = {"messages": [{"role": "user", "content": "Name three colours and describe each one."}], "lora": lora,
            "sampling": {"temperature": 0, "max_tokens": 16, "ignore_eos": True}}
    resp = client.post("/generate", json=body, headers=KEY)
    assert resp.status_code == 200, resp.text
    return "".join(json.loads(line).get("text", "") for line in resp.text.splitlines() if line.strip())


def test_requests_for_more_adapters_than_resident_slots_wait_and_answer_as_alone(client: TestClient) -> None:
    alone = {n: answer(client, n) for n in ("", *NAMES)}
    lm = client.app.state.decoder.engine.lm  # type: ignore[attr-defined]
    assert lm.lora.evictions >= 2
    order = ["a", "b", "", "c", "a", "c", "b", ""]
    with ThreadPoolExecutor(len(order)) as pool:  # more adapters at once than --max-loras 1: each waits its turn
        got = list(pool.map(lambda n: answer(client, n), order))
    assert got == [alone[n] for n in order]
    assert not lm.lora.users and len(lm.lora.loaded) == 1
    assert [d["name"] for d in client.get("/health").json()["loras"]] == list(NAMES)
