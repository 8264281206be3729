"""Tokenizers and a reference for the chat render tests: each tiny family's, the demo model's, and a Llama-style
(SentencePiece/Metaspace) one, which adds a prefix space per encode call."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from epd_builders.tiny import FAMILIES
from epd_builders.tokenizer import SPECIAL_TOKENS, corpus
from epd_builders.tokenizer import chat_template as image_template
from epd_models.chat import chat_template
from epd_models.demo import DEMO_DIR


def load(model_dir: Path) -> tuple[Any, str]:
    """A fresh tokenizer (facts are cached per object) and its chat template."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, chat_template(tok, model_dir)


def metaspace_tokenizer() -> tuple[Any, str]:
    """Llama-style: BPE over "▁"-joined words, a prefix "▁" on the first word of each encode call, and byte
    fallback (<0x0A> for a newline), so no text is unknown."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())["model"]
    vocab = dict(spec["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    tok.model = models.BPE(vocab, [tuple(m) for m in spec["merges"]], unk_token="<unk>", byte_fallback=True)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", extra_special_tokens={"image_token": "<image>"})
    return fast, image_template("<image>")


def all_tokenizers(tiny_model_dirs: dict[str, Path]) -> dict[str, tuple[Any, str]]:
    out = {family: load(tiny_model_dirs[family]) for family in FAMILIES}
    out["demo"] = load(DEMO_DIR)
    out["metaspace"] = metaspace_tokenizer()
    return out


def today(tok: Any, messages: list[dict[str, Any]], template: str) -> list[int]:
    """render() before the fix: the whole prompt tokenized in one call, user text included."""
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def added_ids(tok: Any) -> set[int]:
    return set(tok.added_tokens_decoder) | set(tok.all_special_ids)


def user(text: str, *, images: int = 0, name: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "user", "content": [*({"type": "image"} for _ in range(images)),
                                                       {"type": "text", "text": text}]}
    if name is not None:
        msg["name"] = name
    return msg


def test_metaspace_tokenizer_adds_a_prefix_space_per_call() -> None:
    """The hazard the parity tests guard against: encoding pieces apart changes the tokens at the seams."""
    tok, _ = metaspace_tokenizer()
    whole = tok("The shape is red.", add_special_tokens=False)["input_ids"]
    pieces = [i for t in ("The sha", "pe is red.") for i in tok(t, add_special_tokens=False)["input_ids"]]
    assert whole != pieces
