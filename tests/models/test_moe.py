"""Qwen3-VL-MoE's LM half: its fused experts load as transformers' from_pretrained loads them, in the layout
save_pretrained writes and in the transposed one the hub's checkpoints hold (epd_models/base.py
`convert_layouts_on_load`), and the tiny checkpoint's experts all take part (tests/models/test_parity.py and the other
per-family tests check the tokens)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

FAMILY = "qwen3_vl_moe"
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs[FAMILY]


def hub_layout(model_dir: Path, out: Path) -> Path:
    """A copy of the checkpoint with each expert tensor stored as the hub's Qwen3-VL-MoE checkpoints store it:
    dims 1 and 2 swapped."""
    shutil.copytree(model_dir, out)
    state = load_file(str(model_dir / "model.safetensors"))
    swapped = {k: v.transpose(1, 2).contiguous() if k.endswith(EXPERTS) else v for k, v in state.items()}
    save_file(swapped, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def lm_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The LM half's tensors, named as the checkpoint's (model.language_model.*, lm_head.*)."""
    return {k if k.startswith("lm_head.") else f"model.{k}": v
            for k, v in LanguageHalf(model_dir).module.state_dict().items()}


def reference_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForImageTextToText.from_pretrained(model_dir).state_dict())


@pytest.mark.parametrize("layout", ["save_pretrained", "hub"])
def test_the_lm_half_holds_what_from_pretrained_loads(model_dir: Path, tmp_path: Path, layout: str) -> None:
    source = model_dir if layout == "save_pretrained" else hub_layout(model_dir, tmp_path / "hub")
    on_disk = load_file(str(source / "model.safetensors"))
    ours, ref = lm_state(source), reference_state(model_dir)
    experts = [k for k in ours if k.endswith(EXPERTS)]
    assert len(experts) == 2 * 3  # every LM layer is sparse
    for key in experts:
        assert (on_disk[key].shape == ref[key].shape) == (layout == "save_pretrained"), key
    assert all(torch.equal(v, ref[k]) for k, v in ours.items())
    theirs = reference_state(source)  # transformers reads the hub copy to the same weights
    assert all(torch.equal(theirs[k], ref[k]) for k in experts)


def test_experts_of_neither_layout_are_refused(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bad"
    shutil.copytree(model_dir, out)
    state = load_file(str(model_dir / "model.safetensors"))
    key = next(k for k in state if k.endswith(EXPERTS[0]))
    state[key] = state[key][:, :-1].contiguous()  # one row short: no transpose makes it fit
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="size mismatch"):
        LanguageHalf(out)


def test_every_expert_takes_part_and_matters(model_dir: Path) -> None:
    """Over one image prompt's prefill and decode every layer routes tokens to all its experts, and zeroing one
    expert changes the greedy answer: the MoE's weights are exercised, not bypassed."""
    vision, lm = VisionHalf(model_dir), LanguageHalf(model_dir)
    ids = lm.tokenizer("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
                       "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    prompt = build_prompt(lm, ids, vision.encode([make_image(224, 224, "blue", "square")]))
    chosen: dict[int, set[int]] = {}
    layers = lm.module.language_model.layers
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: chosen.setdefault(i, set()).update(out[2].flatten().tolist()))
        for i, layer in enumerate(layers)]
    try:
        answer = list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), 12, eos_ids=set()))
    finally:
        for h in hooks:
            h.remove()
    experts = layers[0].mlp.experts.num_experts
    assert chosen == {i: set(range(experts)) for i in range(len(layers))}
    with torch.no_grad():
        layers[0].mlp.experts.down_proj[0].zero_()
    assert list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), 12, eos_ids=set())) != answer
