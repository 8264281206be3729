"""The language half ties lm_head to the input embeddings exactly when transformers does.

transformers ties by the composite model's `_tied_weights_keys` when the TOP-LEVEL config says
`tie_word_embeddings` (some families' configs forward a legacy text_config flag to the top first), so a checkpoint
saved tied (no lm_head.weight on disk) whose two levels disagree loads in one family and not in another. Each
family, in each config shape: transformers loads the same checkpoint, and EPD ties iff it tied; where it ties, the
decoder half generates what transformers generates; where it does not, EPD refuses (transformers would draw a random
lm_head) instead of serving one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, GenerationConfig

from decoder_service.generate import generate
from decoder_service.prompt import build_prompt
from epd_builders.tiny import FAMILIES
from epd_models.halves import LanguageHalf

# (top-level tie_word_embeddings, text_config's): the shape, its mirror, and the two consistent ones
SHAPES = {"top_true_text_false": (True, False), "top_false_text_true": (False, True),
          "both_true": (True, True), "both_false": (False, False)}
NUM_NEW = 8


def _checkpoint(src: Path, dst: Path, top: bool, text: bool, drop: tuple[str, ...] = ("lm_head.weight",),
                lm_head_like_embeddings: bool = False) -> Path:
    """A copy of src with the two tie flags set and the `drop`ped tensors absent (as a tied save writes it)."""
    shutil.copytree(src, dst)
    tensors = dict(load_file(str(src / "model.safetensors")))
    embed = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    if lm_head_like_embeddings:  # under the checkpoint's own key (the legacy layout's language_model.lm_head.*)
        tensors[next(k for k in tensors if k.endswith("lm_head.weight"))] = tensors[embed].clone()
    tensors = {k: v for k, v in tensors.items() if not k.endswith(drop)}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"], cfg["text_config"]["tie_word_embeddings"] = top, text
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _transformers_ties(model: torch.nn.Module) -> bool:
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight  # type: ignore[operator]
    return bool(out.data_ptr() == inp.data_ptr())


def _greedy_parity(model: torch.nn.Module, lm: LanguageHalf) -> None:
    ids = lm.tokenizer("What color is the shape? It is", add_special_tokens=False)["input_ids"]
    ours = list(generate(lm, build_prompt(lm, ids, []), lambda x: int(torch.argmax(x)), NUM_NEW, eos_ids=set()))
    cfg = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = model.generate(input_ids=torch.tensor([ids]), generation_config=cfg)  # type: ignore[operator]
    assert ours == ref[0, len(ids):].tolist()


def _check_same_as_transformers(model_dir: Path) -> bool:
    """EPD ties iff transformers ties; returns whether it did."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    tied = _transformers_ties(model)
    lm_head_on_disk = any(k.endswith("lm_head.weight") for k in load_file(str(model_dir / "model.safetensors")))
    if not tied and not lm_head_on_disk:
        with pytest.raises(ValueError, match=r"lacks LM weights: \['lm_head.weight'\]"):
            LanguageHalf(model_dir)
        return tied
    lm = LanguageHalf(model_dir)
    assert (lm.module.lm_head.weight is lm.module.language_model.embed_tokens.weight) == tied
    assert torch.equal(lm.module.lm_head.weight, model.get_output_embeddings().weight)
    _greedy_parity(model, lm)
    return tied


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_language_half_ties_exactly_when_transformers_does(tiny_model_dirs: dict[str, Path], tmp_path: Path,
                                                               family: str, shape: str) -> None:
    top, text = SHAPES[shape]
    tied = _check_same_as_transformers(_checkpoint(tiny_model_dirs[family], tmp_path / family, top, text))
    if top:  # the case: transformers ties by the top-level flag, whatever the text config says
        assert tied


def test_a_loaded_lm_head_equal_to_the_embeddings_is_shared(tiny_model_dirs: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """A checkpoint that writes both (torch .bin style): tied, one tensor, as transformers does."""
    dst = _checkpoint(tiny_model_dirs["internvl"], tmp_path / "both", True, False, drop=(),
                      lm_head_like_embeddings=True)
    assert _check_same_as_transformers(dst)


def test_a_loaded_lm_head_unlike_the_embeddings_is_kept(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The config says tie but the checkpoint holds a different lm_head: both keep their own weights."""
    dst = _checkpoint(tiny_model_dirs["mistral3"], tmp_path / "apart", True, True, drop=())
    assert not _check_same_as_transformers(dst)


def test_embeddings_missing_take_the_lm_head(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """transformers ties symmetrically: a checkpoint with lm_head.weight but no embed_tokens.weight loads."""
    dst = _checkpoint(tiny_model_dirs["llava"], tmp_path / "swapped", True, False, drop=("embed_tokens.weight",))
    assert _check_same_as_transformers(dst)
