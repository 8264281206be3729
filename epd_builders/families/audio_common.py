"""What the tiny audio families share: a tokenizer with their audio tokens, a chat template that writes audio parts,
and the Whisper feature extractor's frame count (Qwen2-Audio and Qwen2.5-Omni both use it).

Kept apart from epd_builders/tokenizer.py so the image families' tokenizers (and so their checkpoints) stay as they
are: these add special tokens, which shifts every learned id.
"""
from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from epd_builders.tokenizer import SPECIAL_TOKENS, chat_template, corpus

SAMPLING_RATE = 16000  # every audio family here: 16 kHz mono
AUDIO_PARTS = ("audio", "input_audio", "audio_url")  # the content part types the template renders as audio


def train_audio_tokenizer(extra_special: list[str], named: dict[str, str], template: str,
                          vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A small byte-level BPE (the image families' corpus) with SPECIAL_TOKENS + `extra_special`; `named` maps
    tokenizer attributes to special tokens ({"audio_token": "<|AUDIO|>"}: then tok.audio_token and
    tok.audio_token_id exist, which the stock processors read)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = list(dict.fromkeys([*SPECIAL_TOKENS, *extra_special]))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", extra_special_tokens=named, chat_template=template)


def audio_chat_template(image_markup: str, video_markup: str | None, audio_markup: str) -> str:
    """The image families' template (epd_builders/tokenizer.py) with one more branch: each audio part
    (AUDIO_PARTS) renders as `audio_markup`."""
    branch = ("{%- elif c['type'] in " + json.dumps(list(AUDIO_PARTS)).replace('"', "'") + " -%}{{ "
              + json.dumps(audio_markup) + " }}")
    text_branch = "{%- elif c['type'] == 'text' -%}"
    base = chat_template(image_markup, video_markup)
    assert base.count(text_branch) == 2, "epd_builders/tokenizer.py's template changed: revisit the audio branch"
    return base.replace(text_branch, branch + text_branch)


def token_id(tok: Any, token: str) -> int:
    """A special token's id (convert_tokens_to_ids is typed for lists too)."""
    found = tok.convert_tokens_to_ids(token)
    assert isinstance(found, int), f"{token!r} is not one token"
    return found


def whisper_frames(num_samples: int, feature_extractor: Any) -> int:
    """The valid mel frames WhisperFeatureExtractor gives a clip of `num_samples` (its feature attention mask's sum
    under padding="max_length", as the Qwen processors call it): one per hop, the clip cut at chunk_length s."""
    samples = min(num_samples, int(feature_extractor.n_samples))
    return math.ceil(samples / int(feature_extractor.hop_length))


def whisper_tokens(frames: int) -> int:
    """A Whisper-style tower's output rows for `frames` mel frames: conv2 (stride 2), then 2x average pooling."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1
