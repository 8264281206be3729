"""The encoder worker: encode scheduled items and publish them by mm_hash. It never gathers."""
from __future__ import annotations

from dataclasses import dataclass

from connector.tensors.producer import ECProducer
from epd_common.audio_limits import AudioLimits
from epd_common.video import VideoLimits
from epd_contracts.audio import AudioPart
from epd_contracts.encode import EncodedItem
from epd_contracts.video import VideoPart
from epd_models.audio_jobs import AudioJob
from epd_models.encode import CachingEncoder, Encoded, ImageJob, Job
from epd_models.halves import VisionHalf

AUDIO_TOKENS_PER_SECOND = 25


@dataclass(frozen=True)
class ScheduledEncoderInput:
    mm_hash: str
    data: bytes  # the image file's bytes, as the client sent them
    detail: str = "auto"  # image_url.detail (part of mm_hash)
    multi_image: bool = False  # one of several images of its prompt, for a family where that matters (part of mm_hash)
    video: VideoPart | None = None  # the bytes are a video and the item these sampled frames of it (part of mm_hash)
    audio: AudioPart | None = None  # the bytes are an audio clip and the item these windows of it (part of mm_hash)
    lora: int = 0  # an image encoded under this LoRA slot of the vision half's (its mm_hash is the adapter's)


def _describe(mm_hash: str, out: Encoded) -> EncodedItem:
    return EncodedItem(mm_hash=mm_hash, num_tokens=out.features.num_tokens, grid_thw=out.features.grid_thw,
                       cached=out.cached)


class EncoderWorker(CachingEncoder):
    """A caching encoder whose store is the connector's producer: what it encodes, decoders can gather."""

    def __init__(self, vision: VisionHalf, producer: ECProducer, max_batch_size: int = 16,
                 max_image_pixels: int = 40_000_000, video_limits: VideoLimits | None = None,
                 audio_limits: AudioLimits | None = None):
        super().__init__(vision, producer, max_batch_size, max_image_pixels, video_limits=video_limits,
                         audio_limits=audio_limits)
        self.producer = producer

    def prepare_inputs(self, inputs: list[ScheduledEncoderInput]) -> tuple[dict[str, Encoded], list[tuple[Job, int]]]:
        """The items held already, and a job for each other with its cost in vision tokens (its image decoded, its
        video part's frames): what the encode scheduler batches (encoder_service/encode_scheduler.py)."""
        held, jobs = self.prepare({item.mm_hash: item.data for item in inputs},
                                  {item.mm_hash: item.detail for item in inputs if item.detail != "auto"},
                                  {item.mm_hash for item in inputs if item.multi_image},
                                  {item.mm_hash: item.video for item in inputs if item.video is not None},
                                  {item.mm_hash: item.audio for item in inputs if item.audio is not None},
                                  {item.mm_hash: item.lora for item in inputs if item.lora})
        return held, [(job, self.cost(job)) for job in jobs]

    def cost(self, job: Job) -> int:
        """An item's vision tokens for the batch budget: an image's by the family's count, a video part's as its
        frames' counted as images, an audio item's as 25 tokens a second of its clip (the Whisper-style towers' rate:
        an estimate for a chunk, which encodes only its windows)."""
        if isinstance(job, ImageJob):
            return self.vision.image_tokens(job.image.size)
        if isinstance(job, AudioJob):
            return max(1, round(job.seconds * AUDIO_TOKENS_PER_SECOND))
        return sum(self.vision.image_tokens(frame.size) for frame in job.clip.frames)

    def describe(self, inputs: list[ScheduledEncoderInput], done: dict[str, Encoded]) -> list[EncodedItem]:
        return [_describe(item.mm_hash, done[item.mm_hash]) for item in inputs]

    def execute_mm_encoder(self, scheduled_encoder_inputs: list[ScheduledEncoderInput]) -> list[EncodedItem]:
        """Encode what is not held yet and store it by mm_hash. No gather; empty input is a no-op."""
        if not scheduled_encoder_inputs:
            return []
        done = self.encode({item.mm_hash: item.data for item in scheduled_encoder_inputs},
                           {item.mm_hash: item.detail for item in scheduled_encoder_inputs if item.detail != "auto"},
                           {item.mm_hash for item in scheduled_encoder_inputs if item.multi_image},
                           {item.mm_hash: item.video for item in scheduled_encoder_inputs if item.video is not None},
                           {item.mm_hash: item.audio for item in scheduled_encoder_inputs if item.audio is not None},
                           {item.mm_hash: item.lora for item in scheduled_encoder_inputs if item.lora})
        return [_describe(item.mm_hash, done[item.mm_hash]) for item in scheduled_encoder_inputs]
