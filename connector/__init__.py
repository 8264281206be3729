"""ZeroMQ encoder-cache connector: encoders save embeddings, decoders gather them by mm_hash."""

from __future__ import annotations

from connector.cache import EmbeddingCache
from connector.consumer import ECConsumer
from connector.producer import ECProducer
from connector.types import EncoderOutput, InvalidEmbeddings, MissingEmbeddings
from connector.wire import MAGIC_VERSION, WireError, decode_message, encode_message, tensor_from_frame

__all__ = [
    "MAGIC_VERSION",
    "ECConsumer",
    "ECProducer",
    "EmbeddingCache",
    "EncoderOutput",
    "InvalidEmbeddings",
    "MissingEmbeddings",
    "WireError",
    "decode_message",
    "encode_message",
    "tensor_from_frame",
]
