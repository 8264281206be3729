"""The quantization scheme a checkpoint declares in config.json's `quantization_config`, and the `--quantization`
flag checked against it (vLLM's rule: a value that disagrees with the checkpoint is refused).

Formats served (the names are vLLM's `--quantization` values):
  fp8                 block-wise e4m3 weights with `weight_scale_inv` (transformers' FineGrainedFP8: Qwen3-VL-*-FP8)
  compressed-tensors  `float-quantized` (FP8 per output channel, dynamic per-token activations: *-FP8-Dynamic) and
                      `pack-quantized` (int4 in int32, per group: *-quantized.w4a16), parsed by the
                      compressed-tensors library's own config model
  awq                 AutoAWQ GEMM int4 (Qwen2.5-VL-*-AWQ)
  gptq                AutoGPTQ / GPTQModel int4, checkpoint format "gptq"
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
# vLLM's kernel-named values for the same checkpoints: EPD picks its kernels itself, so they mean the format
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "fp8": "fp8", "compressed-tensors": "compressed-tensors",
           "awq": "awq", "gptq": "gptq"}
TOWER_CONFIGS = ("vision_config", "audio_config", "text_config", "thinker_config")


class QuantError(ValueError):
    """A checkpoint EPD will not load: the message names the config key or the tensor."""


@dataclass(frozen=True)
class QuantScheme:
    method: str  # one of METHODS
    kind: str  # "fp8-block", "fp8-channel", "int4-ct", "awq", "gptq"
    block: tuple[int, int] = (0, 0)  # fp8-block: [rows, columns] of one scale's block
    group: int = 0  # int4: input columns per scale
    symmetric: bool = True  # int4-ct: no zero points

    @property
    def label(self) -> str:
        """What the log and /health say."""
        detail = f" block {self.block[0]}x{self.block[1]}" if self.kind == "fp8-block" else ""
        return f"{self.method} ({self.kind}{detail}{f', group {self.group}' if self.group else ''})"


def read_scheme(model_dir: str | Path) -> QuantScheme | None:
    """The scheme config.json declares, None for an unquantized checkpoint; QuantError for one EPD cannot serve."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    for part in TOWER_CONFIGS:  # a per-part config no loader (transformers' included) reads: never guess
        sub = raw.get(part)
        if isinstance(sub, dict) and "quantization_config" in sub:
            raise QuantError(f"config.json {part}.quantization_config: a quantization config per model part is "
                             "not supported (only the checkpoint's top-level quantization_config is read)")
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantError("config.json quantization_config: expected an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    if method in ("awq", "gptq"):
        return _int4(method, qc)
    raise QuantError(f"config.json quantization_config.quant_method {method!r}: not supported; EPD serves "
                     f"{', '.join(METHODS)}")


def check_flag(scheme: QuantScheme | None, flag: str | None) -> None:
    """`--quantization` (None: from the checkpoint) against the checkpoint's scheme."""
    if flag is None:
        return
    want = ALIASES.get(flag)
    if want is None:
        raise QuantError(f"--quantization {flag!r}: expected one of {', '.join(sorted(ALIASES))}")
    have = scheme.method if scheme else "none (unquantized)"
    if want != have:
        raise QuantError(f"--quantization {flag} disagrees with the checkpoint's quantization_config ({have}); "
                         "leave it out to use the checkpoint's (EPD does not quantize weights while loading)")


def _fp8(qc: dict[str, Any]) -> QuantScheme:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantError(f"quantization_config.activation_scheme {qc.get('activation_scheme')!r}: only dynamic")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise QuantError(f"quantization_config.fmt {qc.get('fmt')!r}: only e4m3")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantError(f"quantization_config.weight_block_size {block!r}: expected two positive integers")
    return QuantScheme("fp8", "fp8-block", block=(block[0], block[1]))


def _int4(method: str, qc: dict[str, Any]) -> QuantScheme:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise QuantError(f"quantization_config.bits {bits!r}: only 4-bit {method} is supported")
    if not (isinstance(group, int) and group > 0 and group % 8 == 0):
        raise QuantError(f"quantization_config.group_size {group!r}: expected a positive multiple of 8 "
                         "(per-channel, -1, is not supported)")
    if method == "awq" and (str(qc.get("version", "gemm")).lower() != "gemm" or not qc.get("zero_point", True)):
        raise QuantError(f"quantization_config: AWQ version {qc.get('version')!r} with zero_point "
                         f"{qc.get('zero_point')!r}: only the GEMM layout with zero points is supported")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") != "gptq":
        raise QuantError(f"quantization_config.checkpoint_format {qc.get('checkpoint_format')!r}: only \"gptq\"")
    return QuantScheme(method, method, group=group, symmetric=bool(qc.get("sym", True)))


def _compressed(qc: dict[str, Any]) -> QuantScheme:
    from compressed_tensors.quantization import QuantizationConfig  # the format's own config model

    try:
        parsed = QuantizationConfig.model_validate(qc)
    except Exception as exc:  # noqa: BLE001 - pydantic's error, one line
        raise QuantError(f"quantization_config (compressed-tensors): {str(exc).splitlines()[0]}") from None
    groups = list(parsed.config_groups.values())
    if len(groups) != 1:
        raise QuantError(f"quantization_config.config_groups: {len(groups)} groups; one scheme for every layer "
                         "is supported")
    weights, acts = groups[0].weights, groups[0].input_activations
    fmt = str(parsed.format)
    if fmt == "float-quantized" and weights and weights.type == "float" and weights.num_bits == 8 \
            and weights.strategy == "channel" and (acts is None or acts.dynamic is True):
        return QuantScheme("compressed-tensors", "fp8-channel", block=(1, 0))
    if fmt == "pack-quantized" and weights and weights.type == "int" and weights.num_bits == 4 \
            and weights.strategy == "group" and weights.group_size and acts is None:
        return QuantScheme("compressed-tensors", "int4-ct", group=int(weights.group_size),
                           symmetric=bool(weights.symmetric))
    raise QuantError(f"quantization_config (compressed-tensors): format {fmt!r} with weights {weights} and input "
                     f"activations {acts}: EPD serves float-quantized FP8 per channel (dynamic activations) and "
                     "pack-quantized int4 per group (weight-only)")
