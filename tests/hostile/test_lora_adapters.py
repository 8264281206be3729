"""Hostile LoRA adapters are refused with an error naming what is wrong, before any weight is used: a rank above
--max-lora-rank, shapes that do not match the base, NaN or infinite weights, a `target_modules` naming nothing, a path
outside the allowed folder, a huge file, pickle, the vision tower's linears; at start the decoder exits 2 with the
line, and flags that cannot work together are a usage error."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoder_service.cli import parse_args
from decoder_service.lora import check_lora_flags
from epd_common.startup import ConfigError
from epd_models.halves import LanguageHalf
from epd_models.lora.peft_format import WEIGHTS, LoRAError, LoRAWeights, linear_shapes, read_adapter
from tests.lora_adapters import make_adapter
from tests.ports import REUSE_PORT_ENV, held_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lm(tiny_model_dirs: dict[str, Path]) -> LanguageHalf:
    return LanguageHalf(tiny_model_dirs["llava"])


@pytest.fixture(scope="module")
def good(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dirs["llava"], tmp_path_factory.mktemp("lora") / "good", seed=0, rank=8)


def read(lm: LanguageHalf, path: Path, max_rank: int = 16, root: Path | None = None) -> object:
    return read_adapter("x", path, family=lm.adapter, shapes=linear_shapes(lm.module), max_rank=max_rank,
                        dtype=lm.dtype, root=root)


def edited(good: Path, out: Path, edit: object) -> Path:
    """A copy of `good` whose tensors `edit` (a callable on the state dict) changes."""
    shutil.copytree(good, out)
    state = load_file(str(out / WEIGHTS))
    edit(state)  # type: ignore[operator]
    save_file(state, str(out / WEIGHTS))
    return out


def test_a_good_adapter_is_read(lm: LanguageHalf, good: Path) -> None:
    adapter = read(lm, good)
    assert adapter.rank == 8 and len(adapter.weights) == 2 * 7  # type: ignore[attr-defined]


def test_a_rank_above_max_lora_rank_is_refused(lm: LanguageHalf, good: Path) -> None:
    with pytest.raises(LoRAError, match="rank 8 is above --max-lora-rank 1"):
        read(lm, good, max_rank=1)


def test_shapes_that_do_not_match_the_base_are_refused(lm: LanguageHalf, good: Path, tmp_path: Path) -> None:
    def cut(state: dict[str, torch.Tensor]) -> None:
        key = next(k for k in state if k.endswith("q_proj.lora_A.weight"))
        state[key] = state[key][:, :-1].contiguous()

    with pytest.raises(LoRAError, match=r"do not match the base linear \(64 in"):
        read(lm, edited(good, tmp_path / "cut", cut))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_infinite_weights_are_refused(lm: LanguageHalf, good: Path, tmp_path: Path, bad: float) -> None:
    def poison(state: dict[str, torch.Tensor]) -> None:
        state[next(k for k in state if k.endswith("lora_B.weight"))][0, 0] = bad

    with pytest.raises(LoRAError, match="not finite"):
        read(lm, edited(good, tmp_path / "bad", poison))


def test_target_modules_naming_nothing_is_refused(lm: LanguageHalf, good: Path, tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match="names nothing in this model"):
        read(lm, edited(good, tmp_path / "empty", lambda state: state.clear()))
    renamed = edited(good, tmp_path / "other", lambda s: s.update({k.replace("q_proj", "qq_proj"): s.pop(k)
                                                                    for k in list(s) if "q_proj" in k}))
    with pytest.raises(LoRAError, match="qq_proj.*not a linear of this model"):
        read(lm, renamed)


def test_vision_tower_tensors_go_to_the_encoders_which_check_them(lm: LanguageHalf, good: Path, tmp_path: Path,
                                                                  tiny_model_dirs: dict[str, Path]) -> None:
    """The decoder counts an adapter's vision-tower tensors as the encoders' (encoder_service/lora.py); the
    aggregated mode and runtime loads, with no encoder to apply them, refuse them; an encoder refuses ones that do
    not fit its tower (here the LM's shapes and names under the tower's prefix)."""
    from epd_models.halves import VisionHalf

    def vision(state: dict[str, torch.Tensor]) -> None:
        for k in list(state):
            state[k.replace("language_model", "vision_tower.vision_model.encoder")] = state.pop(k)

    moved = edited(good, tmp_path / "vision", vision)
    read_on_decoder = read(lm, moved)
    assert isinstance(read_on_decoder, LoRAWeights)
    assert not read_on_decoder.weights and read_on_decoder.other_half == len(load_file(str(moved / WEIGHTS)))
    with pytest.raises(LoRAError, match="vision tower"):
        read_adapter("x", moved, family=lm.adapter, shapes=linear_shapes(lm.module), max_rank=16, dtype=lm.dtype,
                     vision=None)
    tower = VisionHalf(tiny_model_dirs["llava"])
    with pytest.raises(LoRAError, match="not a linear of this model's vision half"):
        read_adapter("x", moved, family=tower.adapter, shapes=linear_shapes(tower.module, tower.adapter.vision_prefixes),
                     max_rank=16, dtype=tower.dtype, vision=True)


def test_a_path_outside_the_allowed_folder_is_refused_symlinks_included(lm: LanguageHalf, good: Path,
                                                                        tmp_path: Path) -> None:
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "link").symlink_to(good, target_is_directory=True)
    for path in (good, root / "link", root / ".." / ".." / good.name):
        with pytest.raises(LoRAError, match="outside the allowed folder"):
            read(lm, path, root=root)
    shutil.copytree(good, root / "inside")
    assert read(lm, root / "inside", root=root)


def test_a_huge_file_is_refused_before_it_is_read(lm: LanguageHalf, good: Path, tmp_path: Path) -> None:
    huge = tmp_path / "huge"
    shutil.copytree(good, huge)
    with open(huge / WEIGHTS, "r+b") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB on paper, nothing on disk
    with pytest.raises(LoRAError, match="more than an adapter of rank <= 16 for this model can be"):
        read(lm, huge)


def test_pickle_is_never_loaded(lm: LanguageHalf, good: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(good, pickled)
    (pickled / WEIGHTS).rename(pickled / "adapter_model.bin")
    with pytest.raises(LoRAError, match="pickle: never loaded"):
        read(lm, pickled)


@pytest.mark.parametrize("edit, match", [
    ({"use_dora": True}, "DoRA is not supported"),
    ({"r": 0}, "positive integer r"),
    ({"lora_alpha": "big"}, "finite number"),
    ({"peft_type": "IA3"}, "not a LoRA adapter"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_configs_it_does_not_apply_are_refused(lm: LanguageHalf, good: Path, tmp_path: Path,
                                               edit: dict[str, object], match: str) -> None:
    out = tmp_path / "cfg"
    shutil.copytree(good, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(LoRAError, match=match):
        read(lm, out)


@pytest.mark.parametrize("argv, match", [
    (["--lora-modules", "a=/x"], "needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "b=/y"], "raise --max-cpu-loras"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "must be >= --max-loras 2"),
    (["--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x", "a=/y"], "a name given twice"),
])
def test_flags_that_cannot_work_together_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_lora_flags(parse_args(["--insecure", *argv]))


@pytest.mark.parametrize("value", ["noequals", "=path", '{"name": "a"}', '{"name": "a", "path": "/p", "x": 1}'])
def test_a_malformed_lora_modules_item_is_a_usage_error(value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--insecure", "--enable-lora", "--lora-modules", value])
    assert exc.value.code == 2


@pytest.mark.e2e
def test_the_decoder_exits_2_naming_a_refused_adapter(tiny_model_dirs: dict[str, Path], good: Path,
                                                       tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), **REUSE_PORT_ENV}
    with held_port() as port:
        proc = subprocess.run([sys.executable, "-m", "decoder_service.cli", "--model", str(tiny_model_dirs["llava"]),
                               "--port", str(port), "--insecure", "--kv-cache-memory", "16MiB", "--enable-lora",
                               "--max-lora-rank", "1", "--lora-modules", f"mine={good}"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        "epd-decoder: error: adapter 'mine': rank 8 is above --max-lora-rank 1"


def test_an_encoder_exits_2_naming_vision_tower_weights_that_do_not_fit(tiny_model_dirs: dict[str, Path], good: Path,
                                                                         tmp_path: Path) -> None:
    """The LM's tensors renamed under the vision tower: the decoder would count them as the encoders'; an encoder
    reads them at start and refuses them, as a usage error."""
    def vision(state: dict[str, torch.Tensor]) -> None:
        for k in list(state):
            state[k.replace("language_model", "vision_tower.vision_model.encoder")] = state.pop(k)

    moved = edited(good, tmp_path / "vision", vision)
    env = {**os.environ, "PYTHONPATH": str(REPO), **REUSE_PORT_ENV}
    with held_port() as port:
        proc = subprocess.run([sys.executable, "-m", "encoder_service.cli", "--model", str(tiny_model_dirs["llava"]),
                               "--port", str(port), "--insecure", "--enable-lora", "--lora-modules", f"v={moved}"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("epd-encoder: error: adapter 'v': tensor ") and "not a linear of this model's vision half" \
        in last
