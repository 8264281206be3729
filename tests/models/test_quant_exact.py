"""A quantized checkpoint, served, gives exactly the tokens and logprobs of its dequantized twin (on the CPU the
linears are dequantized once at load into the compute dtype, epd_models/quant/apply.py): greedy and seeded, with an
image, and with a video where the family takes one. The twin is written by the builder's own dequantization
(epd_builders/quantize.py, the compressed-tensors library's for its formats), not the loader's.

Bit-exact needs the same memory alignment: the twin's weights as loaded are memory-mapped from its safetensors file
(64-byte alignment offset 40 here), the dequantized weights are fresh allocations (offset 0), and oneDNN/MKL's
float32 GEMM takes another path for another alignment (measured: the twin against itself with its weights copied
to fresh memory differs in the last bit of a logprob, 1e-6, same tokens). So both are compared with every weight in
fresh memory (bit for bit), and against the twin as loaded (the same tokens, logprobs within 1e-5)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_service.prompt import Prompt, build_prompt
from decoder_service.shell import Engine
from epd_builders.quantize import FORMATS
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.sampling import SamplingParams
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf, VisionHalf
from tests.decoder_service.engine_run import Result, greedy, make_engine, run
from tests.factories import make_image, through_connector
from tests.quant_models import GROUP, QuantModels

CASES = [("qwen2_5_vl", fmt) for fmt in FORMATS] + [("qwen3_vl", "fp8"), ("qwen3_vl_moe", "fp8"), ("llava", "awq")]
VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def _features(twin: Path, family: str) -> list[list[ImageFeatures]]:
    """Per prompt: no item, one image, and (video families) one video, as they reach a decoder."""
    vision = VisionHalf(twin)
    items: list[list[ImageFeatures]] = [[], through_connector(vision.encode([make_image(224, 224, "red")]))]
    if family in VIDEO_FAMILIES:
        frames = [make_image(64, 64, colour) for colour in ("red", "green", "blue", "white")]
        items.append(through_connector([vision.encode_video(frames, fps=2.0)]))
    return items


def _prompt(engine: Engine, feats: list[ImageFeatures]) -> Prompt:
    parts = [{"type": "video" if f.is_video else "image"} for f in feats]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "describe the picture"}]}]
    ids = render(engine.lm.tokenizer, messages, chat_template(engine.lm.tokenizer, engine.lm.model_dir))
    return build_prompt(engine.lm, ids, feats)


def _answers(engine: Engine, items: list[list[ImageFeatures]]) -> list[Result]:
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, logprobs=3)
    # one at a time: a step's batch shape follows when each job arrives, and a batch of other shape may round the
    # last bit of a logprob differently (tests/e2e compare batched answers within 1e-4); alone, each is bit-exact
    return [run(engine, [(_prompt(engine, feats), params)])[0] for feats in items
            for params in (greedy(logprobs=2), seeded)]


def _seen(results: list[Result]) -> list[tuple[str, list]]:
    """Each answer's text and its tokens' logprob entries (how they are grouped into deltas follows timing)."""
    return [(r.text, [lp for e in r.events if e.type == "delta" for lp in e.logprobs or []]) for r in results]


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_quantized_serves_exactly_as_its_dequantized_twin(quant_model_dirs: QuantModels, family: str,
                                                           fmt: str) -> None:
    quant, twin = quant_model_dirs[family, fmt]
    items = _features(twin, family)
    lm = LanguageHalf(quant)
    summary = lm.quant.summary()
    assert summary is not None and summary["dequantized"] > 0 and summary["kept"] == 0
    # fresh: the quantized checkpoint's unquantized tensors (lm_head, embeddings) are memory-mapped too
    got = _seen(_answers(make_engine(quant, _fresh(lm), max_model_len=1024), items))
    assert got == _seen(_answers(make_engine(twin, _fresh(LanguageHalf(twin)), max_model_len=1024), items))
    mapped = _seen(_answers(make_engine(twin, max_model_len=1024), items))
    assert [text for text, _ in got] == [text for text, _ in mapped]
    assert [lp.logprob for _, lps in got for lp in lps] == pytest.approx(
        [lp.logprob for _, lps in mapped for lp in lps], abs=1e-5)
    assert len({text for text, _ in got}) > 2, "degenerate answers: the comparison would prove little"


def _fresh(lm: LanguageHalf) -> LanguageHalf:
    """The half with its weights copied out of the memory-mapped file into fresh (aligned) memory."""
    _fresh_weights(lm.module)
    return lm


def _fresh_weights(*modules: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.data = p.data.clone()


def test_quantized_linears_hold_their_format_bytes(quant_model_dirs: QuantModels) -> None:
    """Kept quantized (the CUDA default, run here through the CPU kernels), an int4 LM's linears hold about a
    quarter of their float32 bytes... of the dequantized twin's; the memory plan counts what is held."""
    from decoder_service.engine.memory_plan import module_bytes

    quant, twin = quant_model_dirs["qwen2_5_vl", "awq"]
    kept, dense = LanguageHalf(quant, quantized="keep"), LanguageHalf(twin)
    assert kept.quant.summary()["kept"] == 14  # type: ignore[index]
    layers = lambda half: module_bytes(half.module.language_model.layers)  # noqa: E731
    assert layers(kept) < layers(dense) / 4
    assert module_bytes(kept.module) < module_bytes(dense.module)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kept_quantized_linears_agree_with_dequantized(quant_model_dirs: QuantModels, fmt: str) -> None:
    """The kernels the CUDA path runs (FP8 scaled matmul with per-token activation scales; tinygemm int4), here on
    the CPU: each linear's output within the activations' quantization error of the dequantized weight's.
    Bound: FP8 e4m3 activations carry a relative error of 2^-4 per element, int4's tinygemm takes bf16 activations
    (2^-8); a dot product of such errors stays below 6 % (FP8) and 2 % (bf16) of the output's scale."""
    quant, _ = quant_model_dirs["qwen2_5_vl", fmt]
    kept, dense = LanguageHalf(quant, quantized="keep"), LanguageHalf(quant, quantized="dequantize")
    bound = 0.06 if fmt in ("fp8", "ct-fp8") else 0.02
    for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
        a, b = (half.module.language_model.layers[0].get_submodule(name) for half in (kept, dense))
        inp = torch.randn(5, b.in_features, generator=torch.Generator().manual_seed(1))
        got, want = a(inp), b(inp)
        assert (got - want).abs().max() <= bound * want.abs().max(), (name, type(a).__name__)


def test_fp8_experts_stay_fp8_and_agree_with_dequantized(quant_model_dirs: QuantModels) -> None:
    """Qwen3-VL-MoE's FP8 release layout (one FP8 tensor per expert), kept quantized: every layer's experts are one
    Fp8Experts module holding FP8 bytes, and a prompt's logits match the dequantized model's (this CPU runs the
    dequantize-per-call path, the same values as dequantized once: 1e-4 of the logits' scale covers the expert
    loop's other summation order)."""
    from epd_models.quant.experts import Fp8Experts

    quant, _ = quant_model_dirs["qwen3_vl_moe", "fp8"]
    kept, dense = LanguageHalf(quant, quantized="keep"), LanguageHalf(quant, quantized="dequantize")
    experts = [m for m in kept.module.modules() if isinstance(m, Fp8Experts)]
    assert len(experts) == kept.config.get_text_config().num_hidden_layers
    assert all(e.gate_proj_q.dtype == torch.float8_e4m3fn for e in experts)
    ids = kept.tokenizer("describe the picture", return_tensors="pt").input_ids
    logits = [half.module.lm_head(half.module.language_model(input_ids=ids).last_hidden_state)
              for half in (kept, dense)]
    assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[1].abs().max()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # how one asks it to dequantize
@pytest.mark.parametrize("fmt", ["fp8", "ct-fp8", "ct-w4a16"])
def test_logits_agree_with_transformers_loading_the_quantized_checkpoint(quant_model_dirs: QuantModels,
                                                                         fmt: str) -> None:
    """Where transformers 5.24 loads the format on the CPU (its FP8 and compressed-tensors loaders, dequantizing:
    it has no CPU kernel for them either), EPD's split path gives its greedy tokens, and the first step's logits
    within 1e-5 of their scale: both hold the same dequantized values (tests/models/test_quant_builders.py), so
    only summation order may differ (our packed prefill against its padded batch, and memory alignment); 1e-5
    relative is ten float32 ulps of headroom over the largest difference seen (0)."""
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig, FineGrainedFP8Config

    from decoder_service.generate import generate

    quant, _ = quant_model_dirs["qwen2_5_vl", fmt]
    cfg = FineGrainedFP8Config(dequantize=True) if fmt == "fp8" else CompressedTensorsConfig(dequantize=True)
    theirs = AutoModelForImageTextToText.from_pretrained(quant, quantization_config=cfg).eval()
    lm = LanguageHalf(quant)
    ids = lm.tokenizer("describe the picture", return_tensors="pt").input_ids
    with torch.no_grad():
        want_logits = theirs(input_ids=ids).logits[0, -1]
        want = theirs.generate(input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()
        got_logits = lm.module.lm_head(lm.module.language_model(input_ids=ids).last_hidden_state)[0, -1]
    got = list(generate(lm, build_prompt(lm, ids[0].tolist(), []), lambda x: int(torch.argmax(x)), 12, eos_ids=set()))
    assert got == want and len(set(got)) > 1
    assert (got_logits - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()


@pytest.mark.parametrize("fmt", ["fp8", "awq"])
def test_the_encoder_half_reads_only_its_own_tensors_of_a_quantized_checkpoint(quant_model_dirs: QuantModels,
                                                                               fmt: str) -> None:
    """The vision half of a quantized checkpoint (its LM quantized, its tower as published) loads no LM tensor, none
    of the quantized ones, and encodes exactly as the twin's."""
    quant, twin = quant_model_dirs["qwen2_5_vl", fmt]
    got, want = VisionHalf(quant), VisionHalf(twin)
    assert got.quant.summary() is not None and got.quant.kept == got.quant.dequantized == 0
    _fresh_weights(got.module, want.module)
    image = [make_image(224, 224, "red")]
    assert torch.equal(got.encode(image)[0].embeds, want.encode(image)[0].embeds)


def test_a_quantized_vision_tower_is_dequantized_by_the_encoder(quant_model_dirs: QuantModels,
                                                               tmp_path: Path) -> None:
    """A checkpoint that quantizes a vision linear too (block FP8 with its scale, as its LM's): the encoder
    dequantizes it at load (it is compute-bound; EPD keeps no vision linear quantized) and encodes exactly as a
    copy holding that linear's dequantized weight in float32."""
    import shutil

    from safetensors.torch import load_file, save_file

    quant, _ = quant_model_dirs["qwen2_5_vl", "fp8"]
    name = "visual.blocks.0.mlp.up_proj"
    tensors = load_file(quant / "model.safetensors")
    w = tensors[f"{name}.weight"]
    scale = torch.full((-(-w.shape[0] // GROUP), -(-w.shape[1] // GROUP)), float(w.abs().max()) / 448)
    q = (w / scale[0, 0]).to(torch.float8_e4m3fn)
    dirs = {}
    for kind, weights in (("quantized", {f"{name}.weight": q, f"{name}.weight_scale_inv": scale}),
                          ("dequantized", {f"{name}.weight": q.float() * scale[0, 0]})):
        dirs[kind] = tmp_path / kind
        shutil.copytree(quant, dirs[kind])
        save_file({**tensors, **weights}, dirs[kind] / "model.safetensors", metadata={"format": "pt"})
    got, want = VisionHalf(dirs["quantized"]), VisionHalf(dirs["dequantized"])
    assert (got.quant.kept, got.quant.dequantized) == (0, 1)
    _fresh_weights(got.module, want.module)
    image = [make_image(224, 224, "red")]
    assert torch.equal(got.encode(image)[0].embeds, want.encode(image)[0].embeds)
