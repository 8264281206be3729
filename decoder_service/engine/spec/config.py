"""`--speculative-config`: vLLM's JSON, checked once at start (a bad one exits 2 naming the key).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

    {"model": "/models/qwen2.5-vl-3b", "num_speculative_tokens": 4}        (method "draft_model")
    {"method": "eagle3", "model": "/models/eagle3-heads", "num_speculative_tokens": 4}

Methods: `ngram` (prompt lookup: the tokens that followed the last occurrence of the sequence's latest n-gram, in its
prompt's text or its own output; decoder_service/engine/spec/ngram.py) and `draft_model` (a smaller checkpoint this
decoder can serve, with the target's tokenizer, decoding greedily on its own pool: spec/draft.py) and `eagle3`
(EAGLE-3 heads in the published format, fed the target's hidden states: spec/eagle3.py). vLLM's other trained heads
(EAGLE-1, Medusa, MTP, ...) are not run by this engine: refused at start with a message rather than started without
speculation.

`disable_by_batch_size` (vLLM's key and rule): no proposals in a step while more sequences than this are in the
engine (decoding, prefilling, waiting or preempted). A verification step
costs k + 1 positions per row; with many rows the step is compute-bound and a rejected position is paid by every
other row, so speculation turns itself off under load (the default, DEFAULT_DISABLE_BY_BATCH_SIZE, is measured:
docs/BENCHMARKS.md, "Speculative decoding").
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # sequences in the engine past which a step proposes nothing (CPU; BENCHMARKS)
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size"}
_NOT_YET = ("eagle", "eagle1", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
_NEEDS_MODEL = ("draft_model", "eagle3")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed per row per step (a verification is k + 1 positions)
    prompt_lookup_max: int = 4  # longest n-gram looked up
    prompt_lookup_min: int = 2  # shortest n-gram that may propose (vLLM's default when only max is given: 1)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str = ""  # draft_model: the draft checkpoint's directory (or a built-in name)


def parse_spec_config(text: str) -> SpecConfig:
    """The flag's JSON as a SpecConfig; ValueError naming what is wrong."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
    method = raw.get("method") or ("draft_model" if raw.get("model") else None)
    if method in _NOT_YET:
        raise ValueError(f"--speculative-config: method {method!r} (trained heads) is not supported by this decoder "
                         "yet; use {\"method\": \"ngram\", ...} or a draft model {\"model\": PATH, ...}")
    if method not in ("ngram", *_NEEDS_MODEL):
        raise ValueError(f"--speculative-config: method must be \"ngram\", \"draft_model\" or \"eagle3\", got "
                         f"{method!r}")
    model = raw.get("model") or ""
    if not isinstance(model, str) or (method in _NEEDS_MODEL) != bool(model):
        raise ValueError("--speculative-config: a draft model or EAGLE-3 heads need \"model\": PATH (a checkpoint "
                         "directory), and ngram takes none")
    k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    hi = _int(raw, "prompt_lookup_max", None, 1, 64)
    lo = _int(raw, "prompt_lookup_min", None, 1, 64)
    if hi is None and lo is None:
        hi, lo = SpecConfig.prompt_lookup_max, SpecConfig.prompt_lookup_min
    hi, lo = hi if hi is not None else lo, lo if lo is not None else 1  # vLLM: either alone sets both ends
    assert hi is not None
    if lo > hi:
        raise ValueError(f"--speculative-config: prompt_lookup_min {lo} > prompt_lookup_max {hi}")
    if k is None:
        raise ValueError("--speculative-config: num_speculative_tokens is required (1 to "
                         f"{MAX_SPECULATIVE_TOKENS})")
    off = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1, 1 << 20)
    assert off is not None
    return SpecConfig(method, k, hi, lo, off, model)


def spec_config_argument(value: str) -> SpecConfig:
    """argparse's type for --speculative-config: a bad one is a usage error naming what is wrong."""
    try:
        return parse_spec_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int(raw: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"--speculative-config: {key} must be an integer from {lo} to {hi}, got {value!r}")
    return value
