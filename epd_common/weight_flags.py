"""The choices and help of the workers' --dtype, --quantization and --quantized-weights flags, torch-free: the
launcher offers and passes them on in the proxy image too, where epd_models is not installed."""
from __future__ import annotations

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --quantization values for the formats EPD reads (epd_models/quant/scheme.py; *_marlin: the same format)
QUANTIZATION_CHOICES = ("fp8", "compressed-tensors", "awq", "gptq", "awq_marlin", "gptq_marlin")
QUANTIZED_WEIGHTS_CHOICES = ("auto", "keep", "dequantize")
QUANTIZATION_HELP = ("the checkpoint's quantization format, as vLLM's flag (default: read from its config.json "
                     "quantization_config; a value that disagrees with the checkpoint exits 2)")
QUANTIZED_WEIGHTS_HELP = ("what a quantized checkpoint's linears become: auto (kept quantized on CUDA, dequantized "
                          "once at load into --dtype on the CPU, where that is faster and exact), keep, dequantize")
