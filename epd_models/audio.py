"""Audio clips for the families that take audio: what the encoder half is given and the adapter hooks.

A clip reaches the vision half (which holds every tower of the encoder: vision and audio) as float32 mono samples
at the family's rate (epd_common/audio_decode.py), with the windows of it this item is (epd_contracts.audio.
AudioPart: the whole clip, or a chunk of whole encoder windows where the family encodes windows independently).
The family's processor makes the features from the WHOLE clip (Qwen's log-mel floor is the clip's maximum - 8, so a
window's features depend on the rest), and the chunk's windows of them go through the tower: a chunk's rows are
exactly those rows of the whole clip's, and the decoder concatenates the chunks in order.

An audio item's rows go to the family's audio token, which is also the prompt's one placeholder per clip (the chat
template writes e.g. <|audio_bos|><|AUDIO|><|audio_eos|>; the decoder repeats <|AUDIO|> once per row). Its M-RoPE
positions, where the family has them, are text positions (one per token, the three axes equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from epd_contracts.audio import AudioConfig
    from epd_contracts.embeddings import ImageFeatures


@dataclass(frozen=True, eq=False)
class AudioClip:
    """One audio item for the encoder half: the whole clip's samples and which windows of it to encode."""

    samples: np.ndarray  # float32 mono at the family's sample rate (AudioConfig.sample_rate)
    first: int = 0  # first encoder window of the item
    count: int = 0  # its windows; 0: to the clip's end
    with_image: bool = False  # the clip's prompt also holds an image (Phi-4 projects speech apart then)


class AudioError(ValueError):
    """A clip the family's audio inputs cannot be made of (a chunk past the clip's end)."""


def window_slice(total: int, size: int, clip: AudioClip) -> slice:
    """The feature frames of `clip`'s windows of `size` frames, of a clip with `total` valid frames."""
    start = clip.first * size
    end = total if clip.count == 0 else min(total, start + clip.count * size)
    if start >= total or end <= start:
        raise AudioError(f"windows [{clip.first}, {clip.first + clip.count if clip.count else 'end'}) are past the "
                         f"clip's end "
                         f"({total} feature frames, {size} a window)")
    return slice(start, end)


def feature_rate(processor: Any) -> int:
    """The sample rate the family's feature extractor takes."""
    fe = getattr(processor, "feature_extractor", None) or processor.audio_processor
    return int(fe.sampling_rate)


def no_audio(name: str) -> AudioError:
    return AudioError(f"audio input is not supported for {name} checkpoints")


class AudioHooks:
    """What the generic adapter answers for a family without audio; audio families override the first three, and
    a family that interleaves a video's sound track with its frames (AudioConfig.in_video) the fourth."""

    name: str

    def audio_config(self, cfg: Any, processor: Any) -> AudioConfig | None:
        """The family's AudioConfig (its rate, window and cut), or None: it takes no audio."""
        return None

    def audio_token_id(self, cfg: Any) -> int | None:
        """The token an audio clip's rows take, which is also its prompt placeholder; None: no audio."""
        return None

    def encode_audios(self, module: Any, processor: Any, cfg: Any, clips: list[AudioClip]) -> list[torch.Tensor]:
        """Each clip's (or chunk's) rows, (tokens, text_hidden): what `ImageFeatures(embeds, audio=True)` holds."""
        raise no_audio(self.name)

    def video_track_span(self, cfg: Any, video: ImageFeatures, track: ImageFeatures) -> list[int]:
        """The tokens that take the place of the video's placeholder when `track` (its sound track's rows) is
        interleaved with the video's rows; ValueError: the family does not."""
        raise ValueError(f"{self.name} checkpoints do not interleave a video's sound track with its frames")
