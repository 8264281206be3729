"""LoRA adapters whose weights reach the vision tower and projector (encoder_service/lora.py): the encoder applies
those, the decoder the language model's, and together they give exactly the tokens of transformers' generate() on
the PEFT-merged model; the encoder keys an image encoded under an adapter by epd_contracts.hashing.adapter_hash, so
it is cached apart from the base model's and another adapter's, and checks that key as it checks every hash."""
from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from connector.tensors.producer import ECProducer
from decoder_service.config import DecoderConfig
from decoder_service.generate import generate
from decoder_service.lora import attach_loras
from encoder_service.config import EncoderConfig
from encoder_service.lora import attach_vision_loras
from encoder_service.server import create_app
from encoder_service.worker import EncoderWorker
from epd_common.lora_flags import LoRAModule
from epd_contracts.hashing import adapter_hash, mm_hash
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.lora.peft_format import LoRAError
from tests.factories import make_image
from tests.lora_adapters import TARGETS, make_adapter, merged_model
from tests.models.test_parity import NUM_NEW, _argmax, _prompt, _reference

# the LM's linears, and the CLIP tower's attention and MLP and the projector's (LLaVA's names)
VISION_TARGETS = (r"(" + TARGETS + r"|.*vision_tower\..*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)"
                  r"|.*multi_modal_projector\.linear_\d)")


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, model = tmp_path_factory.mktemp("lora-vision"), tiny_model_dirs["llava"]
    return {"v": make_adapter(model, root / "v", seed=21, rank=8, targets=VISION_TARGETS),
            "w": make_adapter(model, root / "w", seed=22, rank=8, targets=VISION_TARGETS),
            "lm": make_adapter(model, root / "lm", seed=23, rank=8)}


def modules(adapters: dict[str, Path]) -> tuple[LoRAModule, ...]:
    return tuple(LoRAModule(n, str(p)) for n, p in adapters.items())


def test_the_encoder_and_decoder_halves_give_the_merged_models_tokens(tiny_model_dirs: dict[str, Path],
                                                                      adapters: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["llava"]
    vision, lm = VisionHalf(model_dir), LanguageHalf(model_dir)
    on_encoder = attach_vision_loras(vision, EncoderConfig(enable_lora=True, lora_modules=modules(adapters)))
    on_decoder = attach_loras(lm, DecoderConfig(enable_lora=True, max_loras=3, cpu_exact_linear=True,
                                                lora_modules=modules(adapters)))
    assert on_encoder is not None and on_decoder is not None
    assert sorted(on_encoder.known) == ["v", "w"]  # "lm" has nothing for the vision half
    assert {d["name"]: d["vision"] for d in on_decoder.describe()} == {"v": True, "w": True, "lm": False}
    base_prompt, images, text = _prompt(lm, vision, model_dir, "one_image")
    on_encoder.use(on_encoder.slot("v"))
    try:
        prompt = _prompt(lm, vision, model_dir, "one_image")[0]
    finally:
        on_encoder.use(0)
    assert not prompt.images[0].embeds.equal(base_prompt.images[0].embeds)  # the tower's adapter changed the rows
    got = list(generate(lm, replace(prompt, lora=on_decoder.slot("v")), _argmax, NUM_NEW, set()))
    assert got == _reference(model_dir, text, images, "cpu", merged_model(model_dir, adapters["v"]))
    again = _prompt(lm, vision, model_dir, "one_image")[0]  # use(0): the base tower again, bit for bit
    assert again.images[0].embeds.equal(base_prompt.images[0].embeds)


def test_the_aggregated_mode_and_runtime_loads_refuse_vision_tower_weights(tiny_model_dirs: dict[str, Path],
                                                                          adapters: dict[str, Path]) -> None:
    with pytest.raises(LoRAError, match="vision tower"):
        attach_loras(LanguageHalf(tiny_model_dirs["llava"]), DecoderConfig(
            enable_lora=True, aggregated=True, lora_modules=(LoRAModule("v", str(adapters["v"])),)))


def png(color: str) -> str:
    buf = io.BytesIO()
    make_image(64, 64, color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def encoder(tiny_model_dirs: dict[str, Path], adapters: dict[str, Path]) -> Iterator[tuple[TestClient, EncoderWorker]]:
    cfg = EncoderConfig(enable_lora=True, lora_modules=modules(adapters), insecure=True)
    vision = VisionHalf(tiny_model_dirs["llava"])
    attach_vision_loras(vision, cfg)
    worker = EncoderWorker(vision, ECProducer().start())
    with TestClient(create_app(cfg, worker)) as c:
        yield c, worker


def encode(c: TestClient, **item: Any) -> Any:
    return c.post("/encode", json={"items": [item]})


def test_an_image_under_an_adapter_is_cached_apart_and_its_key_is_checked(
        encoder: tuple[TestClient, EncoderWorker]) -> None:
    c, w = encoder
    data = png("red")
    plain = mm_hash(base64.b64decode(data))
    keys = {"": plain, "v": adapter_hash(plain, "v"), "w": adapter_hash(plain, "w")}
    assert len(set(keys.values())) == 3
    for lora, key in keys.items():
        resp = encode(c, data=data, mm_hash=key, lora=lora)
        assert resp.status_code == 200, resp.text
        assert resp.json()["items"][0] == {**resp.json()["items"][0], "mm_hash": key, "cached": False}
    rows = {lora: w.producer.get_cache_item(key) for lora, key in keys.items()}
    assert all(r is not None for r in rows.values())
    assert len({bytes(r.embeds.numpy()) for r in rows.values() if r is not None}) == 3  # three different encodes
    assert encode(c, data=data, mm_hash=keys["v"], lora="v").json()["items"][0]["cached"]
    forged = encode(c, data=data, mm_hash=plain, lora="v")  # the base model's key for the adapter's rows
    assert forged.status_code == 400 and forged.json()["error"]["code"] == "hash_mismatch"
    video = encode(c, data=data, lora="v", video={"sampling": {"num_frames": 2, "fps": 1.0, "max_pixels": 4096},
                                                  "count": 2, "total": 2})
    assert video.status_code == 400 and video.json()["error"]["code"] == "invalid_lora"  # images only
    for lora in ("lm", "nope"):  # no vision-tower weights here: refused, nothing stored
        refused = encode(c, data=data, lora=lora)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_lora"
        assert not w.producer.has_cache_item(adapter_hash(plain, lora))
