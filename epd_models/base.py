"""The family adapter: one object per model family serves both halves, over what transformers' VLMs share.

Every family in transformers 5 splits the same way: a composite base model whose vision children (tower,
projector, and e.g. LLaVA-NeXT's `image_newline` or Qwen3-VL's DeepStack mergers) turn the processor's image
inputs into rows of the LM's input embeddings (`get_image_features`), and a text model that reads them at the
image tokens' positions. So the generic path is:

- encoder: the processor called on ONE placeholder per image gives the image's token span (what the family
  writes into the prompt in its place) and the vision inputs; `get_image_features` on the vision-only composite
  gives the rows (and Qwen3-VL's DeepStack features), split per image by each span's image-token count;
- decoder: the prompt, rendered with one placeholder per image, gets each span spliced in; the rows are scattered
  into the image-token positions of the embeddings (`merge_image_embeds`).

A family's own code is only where it really differs (a `FamilySpec`'s fields and the hooks below): M-RoPE
positions (Qwen), DeepStack injection (Qwen3-VL), bidirectional attention inside an image (Gemma 3), plain-text
edges around the span (Gemma 3).

Videos (epd_models/video.py: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision) take the same path: a family's
`encode_video` gives one item (a whole video, or a chunk of its frames) whose rows go to the family's video token
(`merge_image_embeds` with `video_token_id`), spliced at the prompt's video placeholder (`splice_media`; Qwen3-VL's
span holds its time stamps), its M-RoPE positions from its grid (epd_models/mrope.py). Splicing spans into the prompt
and merging rows into the embeddings are in epd_models/splice.py.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoModel

from epd_contracts.embeddings import ImageFeatures
from epd_models.audio import AudioHooks

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PretrainedConfig

    from epd_models.video import VideoClip, VideoSettings


class LanguageModules(nn.Module):
    """The decoder's modules, named as the normalized checkpoint keys: language_model.*, lm_head.*."""

    def __init__(self, language_model: Any, hidden_size: int, vocab_size: int):
        super().__init__()
        self.language_model: Any = language_model  # the family's base text model (embed_tokens, layers, norm)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)


@dataclass(frozen=True)
class FamilySpec:
    """What tells one family's checkpoints apart from another's, as data."""

    name: str
    model_types: tuple[str, ...]
    vision_children: tuple[str, ...]  # the composite base model's vision modules and parameters, by name
    feature_inputs: tuple[str, ...]  # the processor outputs `get_image_features` takes
    text_child: str = "language_model"  # the composite base model's text model
    # the config attribute holding the prompt placeholder id (the token the chat template writes per image)
    placeholder_attr: str = "image_token_id"
    # added tokens (a regex over their strings) that may appear in an image's span besides the image token
    layout_tokens: str = ""
    layout_text: tuple[str, ...] = ()  # plain text that may appear between them (Idefics3's row newlines)
    text_edges: tuple[str, str] = ("", "")  # plain text the processor writes around the span (Gemma 3)
    batch_encode: bool = True  # one processor call and one vision forward for a batch of images
    # a batch's rows are bit for bit each image's alone (the encoder batches across requests only then): not
    # Qwen3-VL's, whose vision attention over the batch's joined patch sequence differs in the last bits (5.6e-8)
    batches_exactly: bool = True
    # "low" detail: processor kwargs for the fewest tokens (families with a resolution knob), else None
    low_detail: Callable[[Any], dict[str, Any]] | None = None
    fixed_tokens: Callable[[Any], int] | None = None  # image tokens per image where the family has one count
    # an image's tokens depend on whether its prompt holds other images (LLaVA-OneVision: base tile only), so the
    # encoder is told (`multi_image`) and the flag is part of the image's cache key (epd_contracts.hashing)
    multi_image_variant: bool = False
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # checkpoint keys (after renaming) neither half reads: the other parts of a composite checkpoint (Qwen2.5-Omni's
    # talker and token2wav beside its thinker)
    skip_prefixes: tuple[str, ...] = ()
    # LoRA adapters the checkpoint ships in subfolders, per modality its requests take (Phi-4-multimodal's
    # speech-lora, vision-lora): applied by default, as vLLM's default_mm_loras (decoder_service/lora_defaults.py)
    shipped_loras: tuple[tuple[str, str], ...] = ()


class FamilyAdapter(AudioHooks):
    """A family's checkpoint keys, its vision half and its LM-side merge, positions and forward extras (and, for the
    families that take audio, its audio hooks: epd_models/audio.py; the audio tower and projector are among
    `vision_children`, which name every module of the encoder half)."""

    def __init__(self, spec: FamilySpec):
        self.spec = spec
        self.name, self.model_types = spec.name, spec.model_types
        self.vision_prefixes = tuple(f"{c}." for c in spec.vision_children) + spec.vision_children
        children = "|".join(re.escape(c) for c in spec.vision_children)
        text = re.escape(spec.text_child)
        # on-disk layouts -> our names: legacy top-level (language_model.model.*, vision_tower.*), transformers
        # >= 4.52 (model.language_model.*, model.vision_tower.*), and Qwen2-VL's hub layout (model.layers.*)
        self.key_renames: tuple[tuple[str, str], ...] = (
            (r"^language_model\.model\.", "language_model."),
            (r"^language_model\.lm_head\.", "lm_head."),
            (rf"^model\.{text}\.", "language_model."),
            (rf"^model\.(?=(?:{children})(?:\.|$))", ""),
            (rf"^{text}\.", "language_model."),
            (r"^model\.", "language_model."),
        )

    def normalize_key(self, key: str) -> str:
        for pattern, repl in self.key_renames:
            new, n = re.subn(pattern, repl, key, count=1)
            if n:
                return new
        return key

    def is_vision_key(self, key: str) -> bool:
        return self.normalize_key(key).startswith(self.vision_prefixes)

    # encoder half

    def build_vision(self, cfg: PretrainedConfig) -> nn.Module:
        """The composite base model with only its vision children, parameters on meta (load_half fills them)."""
        from epd_models.meta import params_on_meta

        with params_on_meta():
            base = AutoModel.from_config(cfg)
        for name, _ in list(base.named_children()):
            if name not in self.spec.vision_children:
                setattr(base, name, None)
        for name, _ in list(base.named_parameters(recurse=False)):
            if name not in self.spec.vision_children:
                delattr(base, name)
        convert_layouts_on_load(base, cfg.model_type)
        return base

    def encode(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, images: list[Image.Image],
               detail: str = "auto", multi_image: bool = False) -> list[ImageFeatures]:
        """Each image's rows, span (and grid, DeepStack features): batched where the family allows it.
        `multi_image`: the images are in prompts with several images (matters where `multi_image_variant`)."""
        kwargs = dict(self.spec.processor_kwargs)
        if detail == "low" and self.spec.low_detail is not None:
            kwargs.update(self.spec.low_detail(processor.image_processor))
        groups = [images] if self.spec.batch_encode else [[im] for im in images]
        return [f for group in groups for f in self._encode_group(vision, processor, cfg, group, kwargs)]

    def _encode_group(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, images: list[Image.Image],
                      kwargs: dict[str, Any]) -> list[ImageFeatures]:
        out = processor(text=[processor.image_token] * len(images), images=images, add_special_tokens=False,
                        return_tensors="pt", padding=True, **kwargs)
        added = set(processor.tokenizer.added_tokens_decoder)  # built anew on each access: once per batch
        spans = [_core(ids[mask.bool()].tolist(), added)
                 for ids, mask in zip(out["input_ids"], out["attention_mask"], strict=True)]
        weight = next(vision.parameters())
        inputs = {k: _to(out[k], weight) for k in self.spec.feature_inputs if k in out}
        res = vision.get_image_features(**inputs)  # type: ignore[operator]
        image_id = self.image_token_id(cfg)
        counts = [sum(1 for t in s if t == image_id) for s in spans]
        rows = torch.split(_rows(res.pooler_output), counts)
        deep = getattr(res, "deepstack_features", None)
        per_layer = [torch.split(_rows(d), counts) for d in deep] if deep else None
        grids = out.get("image_grid_thw")
        feats = []
        for i, (span, r) in enumerate(zip(spans, rows, strict=True)):
            grid = tuple(int(x) for x in grids[i]) if grids is not None else None
            feats.append(ImageFeatures(
                embeds=r, grid_thw=grid,  # type: ignore[arg-type]
                span=None if span == [image_id] * len(span) else tuple(span),
                deepstack=torch.stack([d[i] for d in per_layer]) if per_layer else None))
        return feats

    def encode_video(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                     clip: VideoClip) -> ImageFeatures:
        """One video's (or one chunk's) rows, with what the decoder needs besides (its grid, seconds per temporal
        patch, span, DeepStack features), from the frames as the family's video processor and the model's
        `get_video_features` would make them (epd_models/video.py). Families that take video override this."""
        raise ValueError(f"video input is not supported for {self.name} checkpoints")

    def encode_videos(self, vision: nn.Module, processor: Any, cfg: PretrainedConfig, settings: VideoSettings,
                      clips: list[VideoClip]) -> list[ImageFeatures]:
        """Several clips' features; one forward each unless the family joins them (mrope.py, onevision.py)."""
        return [self.encode_video(vision, processor, cfg, settings, clip) for clip in clips]

    # decoder half

    def build_language(self, cfg: PretrainedConfig) -> LanguageModules:
        """The text model and lm_head, parameters on meta (load_half fills them)."""
        from epd_models.meta import params_on_meta

        tc = cfg.get_text_config()
        with params_on_meta():
            lm = LanguageModules(AutoModel.from_config(tc), tc.hidden_size, tc.vocab_size)
        convert_layouts_on_load(lm, cfg.model_type)
        return lm

    def image_token_id(self, cfg: PretrainedConfig) -> int:
        found = getattr(cfg, "image_token_id", None)
        return int(found if found is not None else cfg.image_token_index)

    def video_token_id(self, cfg: PretrainedConfig) -> int | None:
        """The token a video's rows take, which is also its prompt placeholder (Qwen's <|video_pad|>); None: the
        family has no video token."""
        found = getattr(cfg, "video_token_id", None)
        if found is None or int(found) in (self.image_token_id(cfg), self.placeholder_id(cfg)):
            return None
        return int(found)

    def placeholder_id(self, cfg: PretrainedConfig) -> int:
        """The token the chat template writes once per image (Gemma 3: <start_of_image>, else the image token)."""
        found = getattr(cfg, self.spec.placeholder_attr, None)
        return int(found) if found is not None else self.image_token_id(cfg)

    def position_ids(
        self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures]
    ) -> tuple[torch.Tensor, int]:
        """Prefill positions for a (1, L) prompt and the delta that decode positions add."""
        return torch.arange(input_ids.shape[-1]).view(1, -1), 0

    def decode_position_ids(self, past_len: int, rope_delta: int) -> torch.Tensor:
        return torch.tensor([[past_len + rope_delta]])

    def prefill_state(self, cfg: PretrainedConfig, input_ids: torch.Tensor, images: list[ImageFeatures],
                      device: torch.device) -> Any:
        """What a family keeps per prompt for its prefill chunks (Qwen3-VL: DeepStack rows); None for most.
        Dropped once the prompt is prefilled: decode steps see None."""
        return None

    def chunk_end(self, state: Any, start: int, end: int) -> int:
        """Where a prefill chunk from `start` may end, given the budget's `end` (Gemma 3: never inside an image)."""
        return end

    def prefill_kwargs(self, state: Any, start: int, end: int) -> dict[str, Any]:
        """Extra text-model arguments for the prefill chunk [start, end) of a prompt with `state`."""
        return {}

    def attention_mask(self, cfg: PretrainedConfig, mask: torch.Tensor, starts: list[int],
                       states: list[Any]) -> Any:
        """The text model's attention_mask from the slot cache's causal one (rows, 1, new, kv); rows' `states`."""
        return mask


def convert_layouts_on_load(module: nn.Module, model_type: str) -> None:
    """Have `module.load_state_dict` take tensors a checkpoint stores in another layout than the module's, as
    transformers' `from_pretrained` does. Its conversion mapping for `model_type` (transformers/conversion_mapping.py)
    is read, and only the layout fixes decided by shape are applied: a pattern onto itself by one
    `Transpose(check_dims=True)`, today Qwen3-VL-MoE's fused experts (the hub stores gate_up_proj (E, H, 2I) and
    down_proj (E, I, H), the module holds (E, 2I, H) and (E, H, I); `save_pretrained` writes the module's). As
    transformers: a tensor of the parameter's shape stays as it is (square experts are never transposed); one whose
    transpose has that shape is transposed; any other is left for load_state_dict to refuse. Renames are
    `normalize_key`'s, per-expert tensors are not fused here. A hook on the module: the loader (weights.py) needs none."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    swaps = [(c.compiled_sources, c.operations[0]) for c in get_checkpoint_conversion_mapping(model_type) or []
             if isinstance(c, WeightConverter) and c.source_patterns == c.target_patterns and len(c.operations) == 1
             and isinstance(c.operations[0], Transpose) and c.operations[0].check_dims]
    if not swaps:
        return
    shapes = {name: p.shape for name, p in module.named_parameters()}

    def convert(mod: nn.Module, state: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        for key, tensor in list(state.items()):
            want = shapes.get(key.removeprefix(prefix))
            for pattern, op in swaps:
                if want is None or tensor.shape == want or not pattern.search(key) or tensor.dim() != len(want):
                    continue
                swapped = tensor.transpose(op.dim0, op.dim1)
                if swapped.shape == want:
                    state[key] = swapped.contiguous()

    module.register_load_state_dict_pre_hook(convert)


def _to(t: Any, weight: torch.Tensor) -> Any:
    """A processor output onto the vision's device (floating tensors also to its dtype)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return t.to(weight.device, weight.dtype, non_blocking=True)
    return t.to(weight.device, non_blocking=True)


def _rows(features: Any) -> torch.Tensor:
    """get_image_features' output (a tensor, or a tuple or list per image or tile) as (N, hidden) rows."""
    if isinstance(features, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def _core(span: list[int], added: set[int]) -> list[int]:
    """The span without the plain text the processor writes around it (Gemma 3's "\\n\\n"): from its first added
    token to its last. The decoder writes that text itself, so it tokenizes with its neighbours as it should."""
    first = next((i for i, t in enumerate(span) if t in added), 0)
    last = next((i for i in range(len(span) - 1, -1, -1) if span[i] in added), len(span) - 1)
    return span[first : last + 1]
