"""Checks every embedding a decoder receives against its own language model, before it is cached or used.

An encoder of another model (or a broken or hostile one) can send embeddings of the wrong width or token
count, or a span that writes other tokens into the prompt; merged into a prompt they would fail the prefill of
that request at best, and fill the decoder's cache with unusable items at worst. What is checked, per item:
- a floating dtype and 2-D shape (num_tokens, width), width == the LM's input embedding width;
- the span (the image's prompt tokens): only this family's image token and layout tokens (InternVL's `<img>`,
  Pixtral's `[IMG_BREAK]`, Idefics3's `<row_i_col_j>`, ...) and layout text, with exactly num_tokens image
  tokens; a family with layout tokens must send one;
- a video (or a chunk of one: `second_per_grid_t` set): only for a model with a video token; its span, if any,
  holds exactly num_tokens video tokens and besides them only layout tokens, the vision start / end tokens and
  time stamps "<t seconds>" (Qwen3-VL's groups, one per temporal patch), each stamp checked as text;
- num_tokens == what the family yields where it is fixed (LLaVA-1.5); for M-RoPE families (Qwen) t*h*w / merge**2
  of its grid_thw (which must be there, positive, and divisible by the merge size);
- DeepStack features (Qwen3-VL): present, of shape (layers, num_tokens, width) and the embeddings' dtype;
- finite values: a NaN or inf would make its own request's output garbage and is cheap to find (one pass
  over a few MB, next to a prefill over the same tokens).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from epd_contracts.embeddings import ImageFeatures
from epd_models.halves import LanguageHalf
from epd_models.mrope import MRopeAdapter

_STAMP = re.compile(r"<\d{1,7}(\.\d)? seconds>")  # a video's time stamp (Qwen3-VL writes f"<{t:.1f} seconds>")
_MAX_STAMP_TOKENS = 16


class EmbeddingCheck:
    """`check(out) -> reason | None` for ECConsumer(check=...) and the aggregated InlineEncoder."""

    def __init__(self, lm: LanguageHalf):
        cfg: Any = lm.config
        spec = lm.adapter.spec
        self.width = int(lm.module.language_model.embed_tokens.embedding_dim)
        self.merge: int | None = cfg.vision_config.spatial_merge_size if isinstance(lm.adapter, MRopeAdapter) else None
        self.fixed = spec.fixed_tokens(cfg) if spec.fixed_tokens is not None else None
        self.image_id, self.video_id, self.audio_id = lm.image_token_id, lm.video_token_id, lm.audio_token_id
        self.tokenizer, self.vocab = lm.tokenizer, len(lm.tokenizer)
        self.layout = layout_ids(lm.tokenizer, spec.layout_tokens, spec.layout_text)
        self.allowed = self.layout | {self.image_id}  # what a span may hold
        edges = (getattr(cfg, "vision_start_token_id", None), getattr(cfg, "vision_end_token_id", None))
        self.video_markup = self.layout | {int(t) for t in edges if t is not None}  # besides its tokens and stamps
        self.deepstack = deepstack_layers(cfg)

    def __call__(self, out: ImageFeatures) -> str | None:
        e = out.embeds
        if not (e.is_floating_point() and e.dim() == 2):
            return f"expected a 2-D floating tensor, got {e.dtype} of shape {tuple(e.shape)}"
        if e.shape[1] != self.width:
            return f"width {e.shape[1]} != this model's embedding width {self.width} (an encoder of another model?)"
        if out.is_video and self.video_id is None:
            return "a video's embeddings, but this model takes no video"
        # rows alone may be an audio clip's (its kind is its request's, which the connector does not know): their
        # count is the clip's, and an image's ref that gets them is refused when the clip is assembled
        # (decoder_service/video_gather.py)
        if not (self.audio_id is not None and out.audio_shaped):
            span = self._video_span(out) if out.is_video else self._span(out)
            for reason in (span, self._count(out), self._deepstack(out)):
                if reason is not None:
                    return reason
        deepstack_finite = out.deepstack is None or bool(torch.isfinite(out.deepstack).all())
        if not bool(torch.isfinite(e).all()) or not deepstack_finite:
            return "non-finite values (NaN or inf)"
        return None

    def _span(self, out: ImageFeatures) -> str | None:
        if out.span is None:
            return "no span: this model's images have layout tokens around them" if self.layout else None
        if any(t not in self.allowed for t in out.span):
            return "the span holds tokens that are not this model's image layout"
        if sum(1 for t in out.span if t == self.image_id) != out.num_tokens:
            return f"the span's image tokens != the {out.num_tokens} embedding rows"
        return None

    def _video_span(self, out: ImageFeatures) -> str | None:
        if out.span is None:
            return None
        if sum(1 for t in out.span if t == self.video_id) != out.num_tokens:
            return f"the span's video tokens != the {out.num_tokens} embedding rows"
        text: list[int] = []  # the run of plain tokens being read: a time stamp
        for t in (*out.span, -1):  # -1: the end, which ends the last run
            if t == self.video_id or t in self.video_markup or t == -1:
                if text and not self._is_stamp(text):
                    return "the span holds tokens that are not this model's video layout"
                text = []
            elif t == self.image_id or not 0 <= t < self.vocab or len(text) == _MAX_STAMP_TOKENS:
                return "the span holds tokens that are not this model's video layout"
            else:
                text.append(t)
        return None

    def _is_stamp(self, ids: list[int]) -> bool:
        try:
            return _STAMP.fullmatch(str(self.tokenizer.decode(ids))) is not None
        except (OverflowError, TypeError, ValueError):  # ids the tokenizer does not have
            return False

    def _count(self, out: ImageFeatures) -> str | None:
        expected = self.fixed
        if self.merge is not None:
            grid = out.grid_thw
            if grid is None:
                return "grid_thw is missing (this model needs it for positions)"
            if not all(isinstance(x, int) and x > 0 for x in grid) or grid[1] % self.merge or grid[2] % self.merge:
                return f"grid_thw {tuple(grid)} is not positive or not divisible by the merge size {self.merge}"
            expected = math.prod(grid) // self.merge**2
        if expected is not None and out.num_tokens != expected:
            return f"{out.num_tokens} image tokens, but this model expects {expected}"
        return None

    def _deepstack(self, out: ImageFeatures) -> str | None:
        d = out.deepstack
        if not self.deepstack:
            return None if d is None else "DeepStack features sent to a model without DeepStack"
        want = (self.deepstack, out.num_tokens, self.width)
        if d is None or tuple(d.shape) != want or d.dtype != out.embeds.dtype:
            got = None if d is None else (tuple(d.shape), d.dtype)
            return f"DeepStack features must be {want} of {out.embeds.dtype}, got {got}"
        return None


def layout_ids(tokenizer: Any, pattern: str, text: tuple[str, ...]) -> set[int]:
    """Ids of the added tokens whose strings match `pattern`, and of each layout text's tokens."""
    ids: set[int] = set()
    if pattern:
        rx = re.compile(pattern)
        ids |= {i for i, tok in tokenizer.added_tokens_decoder.items() if rx.fullmatch(str(tok.content))}
    for t in text:
        ids |= set(tokenizer(t, add_special_tokens=False)["input_ids"])
    return ids


def deepstack_layers(cfg: Any) -> int:
    """How many DeepStack feature sets this model's images carry (0: none)."""
    return len(getattr(getattr(cfg, "vision_config", None), "deepstack_visual_indexes", None) or ())
