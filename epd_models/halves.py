"""The two halves of a VLM, each loaded from the same checkpoint without the other's weights."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from epd_contracts.audio import AudioConfig
from epd_contracts.embeddings import ImageFeatures
from epd_models.audio import AudioClip, no_audio
from epd_models.base import FamilyAdapter
from epd_models.device import _dtype, resolve_device
from epd_models.meta import meta_parameters
from epd_models.processors import load_processor, register_processors
from epd_models.quant.apply import QuantLoad
from epd_models.quant.scheme import read_scheme
from epd_models.registry import adapter_for, load_config
from epd_models.splice import merge_image_embeds
from epd_models.tensor_parallel import check_split, shard
from epd_models.video import DEFAULT_MAX_BYTES, VIDEO_FAMILIES, VideoClip, VideoSettings, video_settings
from epd_models.weights import load_filtered, tie_loaded, tied_pairs

if TYPE_CHECKING:
    from PIL import Image
    from transformers import Cache

    from epd_models.lora.layers import LoRASet

hf_logging.disable_progress_bar()
register_processors()  # AutoProcessor then builds the image-only processors transformers cannot without torchvision


class VisionHalf:
    """The family's vision children only (tower, projector, and e.g. DeepStack mergers); the LM tensors are never
    read from disk, and its modules are never built (parameters on meta, dropped before loading).

    The module lives on `device`; `encode` takes PIL images and returns CPU features (what the connector
    sends and caches), whatever the device.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype | str | None = None,
                 device: str | torch.device = "cpu"):
        self.model_dir = Path(model_dir)
        self.config = load_config(self.model_dir)
        self.adapter = adapter_for(self.config)
        self.device = resolve_device(device)
        self.dtype = _dtype(self.config, dtype)
        self.lora: LoRASet | None = None  # LoRA adapters with vision-tower weights (encoder_service/lora.py)
        self.module = self.adapter.build_vision(self.config).eval()
        # a quantized tower (where a checkpoint has one) is dequantized: the encoder is compute-bound, not memory-bound
        self.quant = QuantLoad(read_scheme(self.model_dir), self.dtype, self.device, mode="dequantize")
        load_half(self.module, self.model_dir, self.adapter, vision=True, assign=True, transform=self.quant(self.module))
        missing = meta_parameters(self.module)
        if missing:
            raise ValueError(f"checkpoint {self.model_dir} lacks vision weights: {missing[:5]}")
        self.module.to(self.device, self.dtype)
        self.processor = load_processor(self.model_dir)
        self.image_processor = getattr(self.processor, "image_processor", None)  # None: an audio-only family
        self._video_settings: VideoSettings | None = None  # read on the first video
        # what /health reports as model_identity["audio"] (None: the family takes no audio)
        self.audio_config: AudioConfig | None = self.adapter.audio_config(self.config, self.processor)

    @property
    def video_settings(self) -> VideoSettings:
        """The checkpoint's video processor settings (epd_models/video.py), read once."""
        if self._video_settings is None:
            self._video_settings = video_settings(self.model_dir, self.image_processor, self.adapter.name)
        return self._video_settings

    @property
    def batches_exactly(self) -> bool:
        """A batch of images gives each image's features bit for bit as alone (FamilySpec.batches_exactly)."""
        return self.adapter.spec.batches_exactly

    def image_tokens(self, size: tuple[int, int]) -> int:
        """The vision tokens of an image of `size` (width, height), counted by the family's processor where it
        says (`_get_num_multimodal_tokens`, what vLLM asks too), else its patches at the processor's size: what an
        encoder's batch budget counts (an estimate: "low" detail and tiles of some families count less)."""
        width, height = size
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if count is not None:
            try:
                return max(1, int(count(image_sizes=[(height, width)]).num_image_tokens[0]))
            except Exception:  # noqa: BLE001 - a processor that cannot say: count patches below
                pass
        patch = int(getattr(self.processor, "patch_size", 0) or getattr(self.image_processor, "patch_size", 0) or 14)
        size_cfg = getattr(self.image_processor, "size", None)
        longest = size_cfg.get("longest_edge") if isinstance(size_cfg, dict) else getattr(size_cfg, "longest_edge", None)
        scale = min(1.0, longest / max(width, height)) if longest else 1.0
        return max(1, -(-int(width * scale) // patch) * -(-int(height * scale) // patch))

    @torch.inference_mode()
    def encode(self, images: list[Image.Image], detail: str = "auto", multi_image: bool = False) -> list[ImageFeatures]:
        """`multi_image`: the images are each one of several in their prompts (LLaVA-OneVision encodes them apart)."""
        if not images:
            return []
        if self.image_processor is None:
            raise ValueError(f"image input is not supported for {self.adapter.name} checkpoints")
        return _to_cpu(self.adapter.encode(self.module, self.processor, self.config, images, detail, multi_image))

    def encode_video(self, frames: list[Image.Image], fps: float, max_pixels: int | None = None,
                     max_bytes: int | None = None, frame_times: Sequence[float] | None = None,
                     last: bool = True, total_frames: int | None = None) -> ImageFeatures:
        """One video's (or one chunk of a video's) CPU features from its sampled frames (see `video_clip`)."""
        return self.encode_videos([self.video_clip(frames, fps, max_pixels, max_bytes, frame_times, last,
                                                   total_frames)])[0]

    def video_clip(self, frames: list[Image.Image], fps: float, max_pixels: int | None = None,
                   max_bytes: int | None = None, frame_times: Sequence[float] | None = None,
                   last: bool = True, total_frames: int | None = None) -> VideoClip:
        """One video's (or one chunk of a video's) sampled frames at `fps` frames per second, checked for this
        checkpoint (epd_models/video.py: `max_pixels` overrides the checkpoint's pixel budget (its video processor's
        size["longest_edge"]: per frame for Qwen2, over the whole video for Qwen3-VL, unused by LLaVA-OneVision's
        fixed frame size), `max_bytes` bounds the pixel tensors; frames that cannot be made into the family's
        video inputs raise VideoError, a ValueError, when encoded).

        A chunk is frames [first, first + n) of the video's sampled frames, whole temporal patches except the
        video's last chunk, and its features are exactly those frames' rows of the whole video's, so the decoder
        concatenates the chunks: `frame_times` is each frame's time in the source video in seconds (index / video
        fps; Qwen3-VL's time stamps: needed for a chunk, else frame k is at k / fps), `last` says the frames end
        the video (the temporal padding; LLaVA-OneVision's newline row), `total_frames` is the whole video's
        sampled frame count (Qwen3-VL sizes every frame by it: needed for a chunk; None: the frames are the
        whole video, or its last chunk when the family does not need it)."""
        if self.adapter.name not in VIDEO_FAMILIES:  # before any pixel work
            raise ValueError(f"video input is not supported for {self.adapter.name} checkpoints")
        if self.video_settings.pixels_per_video and not last and total_frames is None:
            raise ValueError(f"a chunk of a {self.adapter.name} video needs the video's total_frames")
        return VideoClip(frames, fps, max_pixels, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
                         None if frame_times is None else tuple(frame_times), total_frames, last)

    @torch.inference_mode()
    def encode_videos(self, clips: list[VideoClip]) -> list[ImageFeatures]:
        """Several clips (videos or chunks, of any requests) in as few vision forwards as the family allows, each
        exactly what it gives alone where `batches_exactly` (tests/models/test_encode_batching.py)."""
        if not clips:
            return []
        return _to_cpu(self.adapter.encode_videos(self.module, self.processor, self.config, self.video_settings, clips))


    @torch.inference_mode()
    def encode_audios(self, clips: list[AudioClip]) -> list[ImageFeatures]:
        """Each clip's (or chunk's) CPU features, rows at the family's audio token (epd_models/audio.py); raises
        epd_models.audio.AudioError (a ValueError) where the family takes no audio or a chunk is past the end."""
        if not clips:
            return []
        if self.audio_config is None:
            raise no_audio(self.adapter.name)
        rows = self.adapter.encode_audios(self.module, self.processor, self.config, clips)
        return _to_cpu([ImageFeatures(embeds=r, audio=True) for r in rows])


class LanguageHalf:
    """The LM (embeddings, decoder layers, lm_head) only; vision tensors are never read from disk.

    `quantized`: what a quantized checkpoint's linears become (epd_models/quant/apply.py): "auto" (kept quantized on
    CUDA, dequantized once into `dtype` elsewhere), "keep" or "dequantize"."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype | str | None = None,
                 device: str | torch.device = "cpu", quantized: str = "auto", tp_rank: int = 0, tp_size: int = 1,
                 tp_path: bool = False):
        self.model_dir = Path(model_dir)
        self.config = load_config(self.model_dir)
        self.adapter = adapter_for(self.config)
        self.device = resolve_device(device)  # every tensor the decoder makes for the LM is made here
        self.dtype = _dtype(self.config, dtype)
        # tensor parallelism (epd_models/tensor_parallel.py): this process holds 1/tp_size of the split weights;
        # `ranks` is the decoder's handle on the other ranks, set by the rank 0 that started them. `tp_path`: the
        # split's code (hooks, cuts, collectives) at size 1 too (make gpu-check compares it with the plain path)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ranks: Any = None
        check_split(self.config.get_text_config(), tp_size)
        # NOTE: parameters on meta until loaded (as the vision half's): a random init of a 7B LM costs over a
        # minute of one CPU core (bf16 normal_ is single-threaded), and every value would be overwritten
        self.module = self.adapter.build_language(self.config).eval()
        split = shard(self.module, tp_rank, tp_size) if tp_size > 1 or tp_path else None
        self.quant = QuantLoad(read_scheme(self.model_dir), self.dtype, self.device, mode=quantized, split=split)
        load_half(self.module, self.model_dir, self.adapter, vision=False, assign=True,
                  transform=self.quant(self.module))
        # transformers' rule, not the text config's flag: composite checkpoints may say one thing at each level
        tie_loaded(self.module, tied_pairs(self.config, self.module.language_model, self.adapter.normalize_key))
        missing = meta_parameters(self.module)
        if missing:
            hint = (" (transformers ties lm_head to the input embeddings only where the top-level config's "
                    "tie_word_embeddings is true)") if "lm_head.weight" in missing else ""
            raise ValueError(f"checkpoint {self.model_dir} lacks LM weights: {missing[:5]}{hint}")
        self.module.to(self.device, self.dtype)  # after tying: the tied weight moves once and stays shared
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.generation_config = _generation_config(self.model_dir)
        self.image_token_id = self.adapter.image_token_id(self.config)
        self.placeholder_id = self.adapter.placeholder_id(self.config)  # what the chat template writes per image
        self.video_token_id = self.adapter.video_token_id(self.config)  # a video's rows and its placeholder
        self.audio_token_id = self.adapter.audio_token_id(self.config)  # a clip's rows and its placeholder
        self.lora: LoRASet | None = None  # the LoRA adapters its linears add per row (--enable-lora), None: off

    def embed(self, input_ids: torch.Tensor, images: list[ImageFeatures]) -> torch.Tensor:
        """(1, L) ids (any device) and CPU image (and video) features -> (1, L, H) embeddings on self.device."""
        embeds = self.module.language_model.embed_tokens(self.to_device(input_ids))
        return merge_image_embeds(embeds, input_ids, self.image_token_id, images, self.video_token_id,
                                  self.audio_token_id)

    def position_ids(self, input_ids: torch.Tensor, images: list[ImageFeatures]) -> tuple[torch.Tensor, int]:
        """Prefill positions on self.device (computed on the CPU from CPU ids) and the decode rope delta."""
        positions, delta = self.adapter.position_ids(self.config, input_ids.cpu(), images)
        return self.to_device(positions), delta

    def prefill_state(self, input_ids: torch.Tensor, images: list[ImageFeatures]) -> object:
        """The family's per-prompt state for prefill chunks (Qwen3-VL's DeepStack rows on self.device), or None."""
        return self.adapter.prefill_state(self.config, input_ids.cpu(), images, self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor onto the LM's device without waiting for the GPU (a no-op on the CPU)."""
        return t.to(self.device, non_blocking=True)

    @property
    def kv_heads(self) -> int:
        """K/V heads this rank's pool holds (all of them at tensor-parallel size 1)."""
        text = self.config.get_text_config()
        return int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // self.tp_size

    def forward_rows(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Cache,
                     attention_mask: object, ends: list[int], **extra: object) -> torch.Tensor:
        """Run one packed forward (batch 1: every row's new positions in a row, the cache's plan says whose) with
        the family's prefill extras; return the logits at the packed positions `ends`."""
        out = self.module.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache,
                                         attention_mask=attention_mask, use_cache=True, **extra)
        hidden = out.last_hidden_state[0]
        if ends != list(range(hidden.shape[0])):  # a decode-only step wants every position: no gather
            hidden = hidden.index_select(0, torch.tensor(ends).to(self.device, non_blocking=True))
        return self.module.lm_head(hidden).float()


def _to_cpu(features: list[ImageFeatures]) -> list[ImageFeatures]:
    """Device features -> CPU in one transfer (one sync), split back per image; CPU features are returned as is.

    Blocking on purpose: the connector hands these bytes to ZeroMQ as soon as they are stored.
    """
    if not features or all(f.embeds.device.type == "cpu" for f in features):
        return features
    flat = torch.cat([f.embeds for f in features]).cpu()
    parts = torch.split(flat, [f.num_tokens for f in features])
    deep = [None if f.deepstack is None else f.deepstack.cpu() for f in features]
    return [f.with_tensors(e, d) for e, d, f in zip(parts, deep, features, strict=True)]


def loaded_summary(module: torch.nn.Module) -> dict[str, object]:
    """What a process really holds: its top-level modules and parameter count (for /health; a module holding its weight
    outside its parameters, e.g. a CPU linear prepacked for oneDNN, says how many in `num_packed_parameters`)."""
    return {"modules": sorted(name for name, _ in module.named_children()),
            "num_parameters": sum(p.numel() for p in module.parameters())
            + sum(int(getattr(m, "num_packed_parameters", 0)) for m in module.modules())}


def load_half(module: torch.nn.Module, model_dir: Path, adapter: FamilyAdapter, vision: bool,
              assign: bool = False, transform: Callable[[dict[str, torch.Tensor]], None] | None = None) -> list[str]:
    """Load one half's tensors; returns the module keys the checkpoint did not supply."""
    prefixes, skip = adapter.vision_prefixes, adapter.spec.skip_prefixes
    return load_filtered(
        module, model_dir, rename=adapter.normalize_key,
        keep=lambda name: name.startswith(prefixes) == vision and not (skip and name.startswith(skip)), assign=assign,
        transform=transform,
    )


def _generation_config(model_dir: Path) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # checkpoint without generation_config.json
        return GenerationConfig()
