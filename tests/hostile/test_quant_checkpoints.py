"""Hostile quantized checkpoints: each is refused at start, before any weight loads, with exit 2 and one line naming
the config key or the tensor; never loaded into garbage answers. The in-process check is the one every program runs
(decoder_service.preflight.check_quantized: epd-decoder, and the launcher before it spawns anything; the encoder runs
epd_models.quant.load.check_checkpoint itself); the programs themselves are run for the exit code."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoder_service.preflight import check_quantized
from epd_common.startup import ConfigError
from epd_models.halves import LanguageHalf
from epd_models.quant.scheme import QuantError
from tests.quant_models import QuantModels

LINEAR = "model.layers.0.self_attn.q_proj"  # every quantized tiny Qwen2.5-VL checkpoint has it (its on-disk name)


def _copy(quant_model_dirs: QuantModels, fmt: str, tmp_path: Path) -> Path:
    src, _ = quant_model_dirs["qwen2_5_vl", fmt]
    dst = tmp_path / f"bad-{fmt}"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(model_dir: Path, edit: Callable[[dict], None]) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    edit(cfg)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def _set(key: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = value(tensors[key])
    return edit


def _poke(x: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def poke(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = x
        return t
    return poke


# name -> (format, tensor edit or None, config edit or None, what the refusal must name)
CASES: dict[str, tuple[str, Callable | None, Callable | None, str]] = {
    "unknown_quant_method": ("fp8", None, lambda c: c["quantization_config"].update(quant_method="bitsandbytes"),
                             "quant_method 'bitsandbytes'"),
    "missing_scale": ("fp8", lambda t: t.pop(f"{LINEAR}.weight_scale_inv"), None, f"{LINEAR}.weight_scale_inv"),
    "scale_of_wrong_shape": ("fp8", _set(f"{LINEAR}.weight_scale_inv", lambda s: s[:1]), None,
                             f"{LINEAR}.weight_scale_inv"),
    "zero_scale": ("ct-fp8", _set(f"{LINEAR}.weight_scale", _poke(0.0)), None, f"{LINEAR}.weight_scale"),
    "nan_scale": ("awq", _set(f"{LINEAR}.scales", _poke(float("nan"))), None, f"{LINEAR}.scales"),
    "infinite_scale": ("ct-w4a16", _set(f"{LINEAR}.weight_scale", _poke(float("inf"))), None,
                       f"{LINEAR}.weight_scale"),
    "packed_shape_disagrees_with_group_size": ("awq", None,
                                               lambda c: c["quantization_config"].update(group_size=64),
                                               "qzeros: shape"),
    "packed_weight_truncated": ("gptq", _set(f"{LINEAR}.qweight", lambda q: q[:-1]), None, f"{LINEAR}.qweight"),
    "ct_weight_shape_lies": ("ct-w4a16", _set(f"{LINEAR}.weight_shape", lambda s: s * 2), None,
                             f"{LINEAR}.weight_packed"),
    "quantization_config_on_the_vision_tower": ("fp8", None, lambda c: c["vision_config"].update(
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        "vision_config.quantization_config"),
    "fp8_weight_without_a_config": ("fp8", None, lambda c: c.pop("quantization_config"), ".weight is FP8"),
}


def _bad(quant_model_dirs: QuantModels, tmp_path: Path, case: str) -> tuple[Path, str]:
    fmt, tensors, config, named = CASES[case]
    model_dir = _copy(quant_model_dirs, fmt, tmp_path)
    if tensors is not None:
        _edit_tensors(model_dir, tensors)
    if config is not None:
        _edit_config(model_dir, config)
    return model_dir, named


@pytest.mark.parametrize("case", CASES)
def test_each_hostile_checkpoint_is_refused_before_loading_naming_what_is_wrong(
        quant_model_dirs: QuantModels, tmp_path: Path, case: str) -> None:
    model_dir, named = _bad(quant_model_dirs, tmp_path, case)
    with pytest.raises(ConfigError, match=None) as refused:
        check_quantized(model_dir, None)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises((QuantError, ValueError)) as loaded:  # and loading it anyway never yields a model
        LanguageHalf(model_dir)
    assert named in str(loaded.value) or "quant" in str(loaded.value).lower()


def test_a_quantization_flag_that_disagrees_with_the_checkpoint_is_refused(quant_model_dirs: QuantModels) -> None:
    quant, twin = quant_model_dirs["qwen2_5_vl", "awq"]
    with pytest.raises(ConfigError, match="--quantization gptq disagrees"):
        check_quantized(quant, "gptq")
    with pytest.raises(ConfigError, match="none \\(unquantized\\)"):
        check_quantized(twin, "fp8")
    check_quantized(quant, "awq_marlin")  # vLLM's kernel-named value for the same format


def _program(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    module = {"epd-decoder": "decoder_service.cli", "epd-encoder": "encoder_service.cli",
              "disagg-epd-proxy": "epd_launcher.cli"}[name]
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["epd-decoder", "epd-encoder", "disagg-epd-proxy"])
def test_the_programs_exit_2_with_one_line(quant_model_dirs: QuantModels, tmp_path: Path, name: str) -> None:
    model_dir, named = _bad(quant_model_dirs, tmp_path, "nan_scale")
    workers = ["--insecure"] if name != "disagg-epd-proxy" else []  # the launcher's check runs before any key is asked
    done = _program(name, "--model", str(model_dir), "--port", "0", *workers)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert named in lines[-1] and "Traceback" not in done.stderr
