"""--device / --dtype: parsing, defaults, and where the halves, the slot cache and the sampler put their tensors.

There is no GPU here. The placement tests use the "meta" device as a stand-in accelerator: reading a meta
tensor back to the host (int(), .item(), .tolist()) raises, so a path that runs on meta never waits for the
device; and `OneDevice` records every op that mixes devices (a host tensor meeting a device tensor, which
on a GPU is an error or a hidden copy), so a path with no such op makes its tensors on the model's device.
With --device cuda (`python -m epd_bench.gpu_check`) the placement tests run on that device instead of meta.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from decoder_service.cli import parse_args as decoder_args
from decoder_service.config import DecoderConfig
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.sampling import Sampler
from decoder_service.engine.step_plan import StepPlan
from decoder_service.prompt import build_prompt
from encoder_service.cli import parse_args as encoder_args
from encoder_service.config import EncoderConfig
from epd_contracts.sampling import SamplingParams
from epd_models.chat import chat_template, render
from epd_models.device import resolve_device
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

META = torch.device("meta")
PARSERS = [decoder_args, encoder_args]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
has_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class OneDevice(TorchDispatchMode):
    """Records each op whose tensor arguments are on more than one device (0-d host scalars are fine)."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[tuple[str, set[torch.device]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        devices = {t.device for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            self.mixed.append((str(func), devices))
        return func(*args, **kwargs)


@pytest.fixture
def accel(device: str) -> torch.device:
    """Where the placement tests put the model: meta, unless --device names an accelerator."""
    return META if device == "cpu" else resolve_device(device)


@pytest.fixture(autouse=True)
def insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    """These parse device flags only: workers refuse to start without keys unless EPD_INSECURE=1."""
    monkeypatch.setenv("EPD_INSECURE", "1")


def test_config_defaults_are_auto() -> None:
    for cfg in (DecoderConfig(), EncoderConfig()):
        assert (cfg.device, cfg.dtype) == ("auto", "auto")


@pytest.mark.parametrize("parse", PARSERS)
def test_device_auto_resolves_to_what_this_machine_has(parse: Any) -> None:
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert parse([]).device == expected
    assert parse(["--device", "auto"]).device == expected
    assert parse(["--device", "cpu"]).device == "cpu"


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
@no_cuda
def test_cuda_without_cuda_is_a_usage_error(parse: Any, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--device", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "CUDA is not available" in err


@pytest.mark.parametrize("parse", PARSERS)
@has_cuda
def test_cuda_index_is_accepted_when_present(parse: Any) -> None:
    assert parse(["--device", "cuda"]).device == f"cuda:{torch.cuda.current_device()}"
    assert parse(["--device", "cuda:0"]).device == "cuda:0"


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("value", ["gpu", "cuda:x", "tpu", "mps", "meta", ""])
def test_bad_device_is_a_usage_error(parse: Any, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--device", value])
    assert exc.value.code == 2 and "argument --device" in capsys.readouterr().err


@pytest.mark.parametrize("parse", PARSERS)
def test_dtype_flag(parse: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse([]).dtype == "auto"
    assert parse(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit) as exc:
        parse(["--dtype", "int8"])
    assert exc.value.code == 2 and "argument --dtype" in capsys.readouterr().err


def test_resolve_device() -> None:
    assert resolve_device("cpu") == resolve_device("cpu:0") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_halves_default_to_the_cpu_in_the_checkpoint_dtype(tiny_model_dirs: dict[str, Path]) -> None:
    """What the parity tests (tests/models/test_parity.py) run: the default is device "cpu", dtype as today."""
    d = tiny_model_dirs["qwen2_vl"]
    for half in (VisionHalf(d), LanguageHalf(d), VisionHalf(d, device="cpu"), LanguageHalf(d, "auto", "cpu")):
        assert half.device == torch.device("cpu") and half.dtype == torch.float32
        assert {(p.device, p.dtype) for p in half.module.parameters()} == {(torch.device("cpu"), torch.float32)}


def test_dtype_auto_is_the_checkpoints_and_a_flag_overrides_it(tiny_model_dirs: dict[str, Path],
                                                               tmp_path: Path) -> None:
    d = shutil.copytree(tiny_model_dirs["llava"], tmp_path / "bf16")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    assert LanguageHalf(d).dtype == torch.bfloat16  # as before this flag: the checkpoint's dtype, on any device
    lm = LanguageHalf(tiny_model_dirs["llava"], dtype="bfloat16")
    assert {p.dtype for p in lm.module.parameters()} == {torch.bfloat16}
    assert ModelRunner(lm, max_slots=1, max_len=8).cache.paged_layers[0].keys.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        LanguageHalf(tiny_model_dirs["llava"], dtype="int8")


def test_encoded_features_are_cpu_tensors_and_not_copied_on_the_cpu(tiny_model_dirs: dict[str, Path],
                                                                    device: str) -> None:
    vision = VisionHalf(tiny_model_dirs["qwen2_vl"], device=device)
    feats = vision.encode([make_image(224, 224), make_image(112, 168)])
    assert all(f.embeds.device.type == "cpu" for f in feats)
    if vision.device.type != "cpu":
        return
    # on the CPU the batch output is not copied: both images are views of the one projector output
    assert feats[0].embeds.untyped_storage().data_ptr() == feats[1].embeds.untyped_storage().data_ptr()


def test_paged_cache_makes_everything_on_its_device(accel: torch.device) -> None:
    shape = KVShape(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16)
    cache = PagedCache(shape, num_blocks=6, block_size=4, device=accel)
    layer = cache.paged_layers[0]
    assert layer.keys is not None and layer.keys.device == accel and layer.keys.dtype == torch.float16
    cache.activate(StepPlan(torch.tensor([4, 5, 6], device=accel)))  # block 1, offsets 0..2
    try:
        kv = torch.ones(1, 2, 3, 8, dtype=torch.float16, device=accel)
        keys, values = layer.update(kv, kv, 0)
    finally:
        cache.activate(None)
    assert keys.device == values.device == accel
    block = keys[:, 1] if cache.head_major else keys[1].transpose(0, 1)  # (kv_heads, block_size, head_dim)
    if accel.type != "meta":  # the stand-in accelerator holds no values
        assert block[:, :3].eq(1).all()
    assert cache.nbytes == 2 * 2 * 2 * 8 * 2 * 4 * 6  # layers x K,V x kv heads x head dim x bytes x block x blocks


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_batched_prefill_and_decode_run_on_the_lms_device(tiny_model_dirs: dict[str, Path], family: str,
                                                          accel: torch.device) -> None:
    """CPU prompt ids and CPU image features (as gathered from the connector) into an LM on another device."""
    d = tiny_model_dirs[family]
    vision, lm = VisionHalf(d), LanguageHalf(d)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is the shape"}]}]
    prompt = build_prompt(lm, render(lm.tokenizer, msgs, chat_template(lm.tokenizer, d)),
                          vision.encode([make_image(168, 112, "blue")]))
    lm.module.to(accel)
    lm.device = accel  # what the constructor's `device` sets; everything below derives from it
    with OneDevice() as mode:
        runner = ModelRunner(lm, max_slots=2, max_len=512, chunk=16)
        runner.add("a", prompt)
        runner.add("b", prompt)
        assert {r.embeds.device for r in runner.rows.values()} == {r.positions.device for r in runner.rows.values()} == {accel}
        first = runner.prefill(budget=10_000)  # chunked: several forwards per prompt
        assert set(first) == {"a", "b"} and {t.device for t in first.values()} == {accel}
        nxt = runner.decode({"a": 5, "b": 7})
        assert {t.device for t in nxt.values()} == {accel}
        assert [r.length for r in runner.rows.values()] == [prompt.num_tokens + 1] * 2
        runner.remove("a")  # its blocks go back to the pool
        assert {t.device for t in runner.decode({"b": 3}).values()} == {accel}
    assert mode.mixed == []


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.7, top_k=3, top_p=0.5, seed=1, frequency_penalty=0.1),
])
def test_sampler_chooses_where_the_logits_are_without_reading_them_back(params: SamplingParams,
                                                                       accel: torch.device) -> None:
    sampler = Sampler(params) if accel == META else Sampler(params, accel)  # a meta Generator cannot be made
    for token in (3, 3, 5):
        sampler.accept(token)
    with OneDevice() as mode:
        chosen = sampler.choose(torch.zeros(10, device=accel))
    assert chosen.device == accel and chosen.shape == () and mode.mixed == []
    assert Sampler(params, "cpu").generator.device == torch.device("cpu")


def test_llava_encoder_moves_pixels_to_the_vision_device(tiny_model_dirs: dict[str, Path],
                                                         accel: torch.device) -> None:
    vision = VisionHalf(tiny_model_dirs["llava"])
    vision.module.to(accel)
    images = [make_image(224, 224), make_image(96, 64)]
    with OneDevice() as mode:
        feats = vision.adapter.encode(vision.module, vision.processor, vision.config, images)
    assert [f.embeds.device for f in feats] == [accel, accel] and mode.mixed == []


def test_qwen_encoder_moves_pixels_and_grid_to_the_vision_device(tiny_model_dirs: dict[str, Path],
                                                                 accel: torch.device) -> None:
    """What `get_image_features` is given (Qwen's own code reads grid_thw back, which meta cannot do)."""
    vision = VisionHalf(tiny_model_dirs["qwen2_vl"])
    vision.module.to(accel, torch.float16)
    seen: dict[str, torch.Tensor] = {}
    hidden = vision.config.text_config.hidden_size

    def get_image_features(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> SimpleNamespace:
        seen.update(pixel_values=pixel_values, grid_thw=image_grid_thw)
        return SimpleNamespace(pooler_output=torch.zeros(88, hidden, device=accel))

    vision.module.get_image_features = get_image_features
    feats = vision.adapter.encode(vision.module, vision.processor, vision.config, [make_image(224, 224),
                                                                                  make_image(168, 112)])
    assert seen["pixel_values"].device == seen["grid_thw"].device == accel
    assert seen["pixel_values"].dtype == torch.float16
    assert [f.num_tokens for f in feats] == [64, 24] and feats[1].grid_thw == (1, 8, 12)
