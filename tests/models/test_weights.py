"""Each half reads only its own tensors, from single-file or sharded checkpoints, in either key layout."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from epd_builders.tiny import FAMILIES
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image


def reference(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(load_file(str(model_dir / "model.safetensors")))


def record_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Wrap safetensors.safe_open so every tensor read from disk is recorded by key."""
    reads: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args: object, **kwargs: object):
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_tensor(self, key: str) -> torch.Tensor:
            reads.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr("epd_models.weights.safe_open", Recording)
    return reads


@pytest.mark.parametrize("family", FAMILIES)
def test_each_half_reads_only_its_own_tensors(tiny_model_dirs: dict[str, Path], family: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tiny_model_dirs[family]
    keys = set(reference(model_dir))
    reads = record_reads(monkeypatch)
    vision = VisionHalf(model_dir)
    vision_reads = set(reads)
    reads.clear()
    LanguageHalf(model_dir)
    lm_reads = set(reads)
    assert vision_reads and lm_reads and not vision_reads & lm_reads and vision_reads | lm_reads == keys
    assert all(vision.adapter.is_vision_key(k) for k in vision_reads)


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_model_dirs["qwen2_vl"]
    model = AutoModelForImageTextToText.from_pretrained(src)
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    (sharded / "model.safetensors").unlink()
    model.save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    img = make_image(112, 112)
    assert torch.equal(VisionHalf(sharded).encode([img])[0].embeds, VisionHalf(src).encode([img])[0].embeds)
    a, b = LanguageHalf(sharded).module.state_dict(), LanguageHalf(src).module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family,renames", [
    ("llava", {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}),
    ("qwen2_vl", {"model.": "model.language_model.", "visual.": "model.visual."}),
])
def test_new_key_layout_loads_like_the_legacy_one(tiny_model_dirs: dict[str, Path], tmp_path: Path, family: str,
                                                 renames: dict[str, str]) -> None:
    src, dst = tiny_model_dirs[family], tmp_path / family
    shutil.copytree(src, dst)
    renamed = {}
    for key, tensor in reference(src).items():
        prefix = next((p for p in renames if key.startswith(p)), "")
        renamed[renames[prefix] + key[len(prefix):] if prefix else key] = tensor
    assert set(renamed) != set(reference(src))
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    img = make_image(112, 112)
    assert torch.equal(VisionHalf(dst).encode([img])[0].embeds, VisionHalf(src).encode([img])[0].embeds)
    a, b = LanguageHalf(dst).module.state_dict(), LanguageHalf(src).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tied_lm_head_is_taken_from_the_embeddings(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    src, dst = tiny_model_dirs["qwen2_vl"], tmp_path / "tied"
    shutil.copytree(src, dst)
    tensors = reference(src)
    del tensors["lm_head.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    lm = LanguageHalf(dst).module
    assert lm.lm_head.weight is lm.language_model.embed_tokens.weight


def test_missing_lm_weights_are_an_error_not_random(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    src, dst = tiny_model_dirs["llava"], tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in reference(src).items() if "layers.0." not in k}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks LM weights"):
        LanguageHalf(dst)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_language_half_draws_no_random_weights_it_then_overwrites(tiny_model_dirs: dict[str, Path], family: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7B LM's random init costs over a minute of one CPU core; its parameters stay on meta until loaded."""
    drawn: list[tuple[int, ...]] = []
    real = torch.Tensor.normal_

    def normal_(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.device.type != "meta":
            drawn.append(tuple(self.shape))
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "normal_", normal_)
    lm = LanguageHalf(tiny_model_dirs[family])
    assert drawn == []
    tensors = reference(tiny_model_dirs[family])
    loaded = {k: v for k, v in lm.module.state_dict().items() if k.endswith("embed_tokens.weight")}
    assert loaded and all(any(torch.equal(v, t) for t in tensors.values()) for v in loaded.values())
