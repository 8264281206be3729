"""The encoder worker: encode scheduled items and publish them by mm_hash. It never gathers."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from PIL import Image

from connector import ECProducer, EncoderOutput
from encoder_service.protocol import EncodedItem
from epd_models.halves import VisionHalf
from epd_models.images import load_image

logger = logging.getLogger("epd.encoder")


@dataclass(frozen=True)
class ScheduledEncoderInput:
    mm_hash: str
    data: bytes  # the image file's bytes, as the client sent them


def _describe(out: EncoderOutput, cached: bool) -> EncodedItem:
    return EncodedItem(mm_hash=out.mm_hash, num_tokens=out.num_tokens, grid_thw=out.grid_thw, cached=cached)


class EncoderWorker:
    def __init__(self, vision: VisionHalf, producer: ECProducer, max_batch_size: int = 16,
                 max_image_pixels: int = 40_000_000):
        self.vision, self.producer = vision, producer
        self.max_batch_size, self.max_image_pixels = max_batch_size, max_image_pixels
        self.num_encoded = 0  # items that went through the vision tower
        self.num_already_cached = 0  # items asked for that were already held
        self._lock = threading.Lock()  # one vision forward at a time

    def execute_mm_encoder(self, scheduled_encoder_inputs: list[ScheduledEncoderInput]) -> list[EncodedItem]:
        """Encode what is not held yet and store it by mm_hash. No gather; empty input is a no-op."""
        if not scheduled_encoder_inputs:
            return []
        done: dict[str, EncodedItem] = {}
        todo: dict[str, bytes] = {}
        for item in scheduled_encoder_inputs:
            held = self.producer.get_cache_item(item.mm_hash)
            if held is not None:
                done[item.mm_hash] = _describe(held, cached=True)
            else:
                todo.setdefault(item.mm_hash, item.data)
        self.num_already_cached += len(done)
        try:
            # decode every image first, so bad bytes fail the call before any work is done
            images = {h: load_image(data, self.max_image_pixels) for h, data in todo.items()}
            with self._lock:
                hashes = list(images)
                for start in range(0, len(hashes), self.max_batch_size):
                    done.update(self._encode_batch(hashes[start : start + self.max_batch_size], images))
        except BaseException:
            # decoders already waiting for these (pipelined gather) get their answer now, not at their timeout
            self.producer.mark_failed([h for h in todo if not self.producer.has_cache_item(h)])
            raise
        return [done[item.mm_hash] for item in scheduled_encoder_inputs]

    def _encode_batch(self, hashes: list[str], images: dict[str, Image.Image]) -> dict[str, EncodedItem]:
        # the vision half runs on its device and hands back CPU tensors (one copy per batch): the connector
        # sends their memory as ZeroMQ frames without copying
        outs = [
            EncoderOutput(mm_hash=h, embeds=f.embeds, grid_thw=f.grid_thw)
            for h, f in zip(hashes, self.vision.encode([images[h] for h in hashes]), strict=True)
        ]
        for out in outs:
            self.producer.save_caches(out.mm_hash, out)
        self.num_encoded += len(outs)
        logger.info("encoded %d item(s)", len(outs))
        return {out.mm_hash: _describe(out, cached=False) for out in outs}
