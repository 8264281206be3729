"""The disk tier's file format: one embedding per file, self-describing, keyed, checked before any tensor is built.

    [8 bytes MAGIC][4 bytes header length, little-endian][16 bytes header MAC][msgpack DiskHeader]
    [embeds bytes][DeepStack bytes]

The header carries the model fingerprint the encoder wrote it under, the item's `GetItem` (the wire's own
description: dtype, shapes, span, grid, video timing) and a digest of the payload. Both the header MAC (over the
magic, the length and the header) and the payload digest are blake2b keyed with `file_key(internal key)`, a
secret derived from the fleet's internal key: a file written by anyone who lacks that key (another local user, or
this encoder under another key) fails its check. Without an internal key (--insecure) the key is empty and both
are plain checksums: they catch torn and altered files, not forged ones.

A file is named by a hash of its mm_hash (`file_name`), so no mm_hash ever becomes a path. Reading checks, in
order: the magic, the header length against MAX_HEADER_BYTES and the file's length, the header MAC, the header's
fields (msgspec), the fingerprint, every declared size against the byte cap and the file's exact length (the
tier then checks the name against the mm_hash inside); the payload's digest is checked when the payload is read
(`read_features`), so a torn, altered or forged file is never used.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Annotated

import msgspec
import torch

from connector.control.wire import WireError, tensor_nbytes
from connector.tensors.frames import WireItem
from connector.tensors.replies import read_get_reply
from epd_contracts.ec import GetItem, GetReply
from epd_contracts.embeddings import ImageFeatures

MAGIC = b"EPDEMB\x00\x02"  # format version 2 (keyed); version 1 files are skipped as another format
SUFFIX = ".emb"
MAX_HEADER_BYTES = 1 << 20  # a span of 131,072 ids at 5 msgpack bytes each fits
_DIGEST_BYTES = 16
_PREFIX = struct.Struct(f"<8sI{_DIGEST_BYTES}s")  # magic, header length, header MAC
_KEY_DOMAIN = b"epd/encoder-disk-tier/v2/file-mac"  # what the internal key is used for here, and nothing else
_HEADER_PERSON, _PAYLOAD_PERSON = b"epd-disk-header", b"epd-disk-payload"  # blake2b's own domain separation


class DiskFormatError(ValueError):
    """A file that is not a usable embedding of this model: skipped (and removed when it is ours to remove)."""


class DiskHeader(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fingerprint: Annotated[str, msgspec.Meta(max_length=128)]
    item: GetItem  # found, frame 0 (and DeepStack frame 1): the payload in wire order
    payload_bytes: Annotated[int, msgspec.Meta(ge=0)]
    digest: Annotated[str, msgspec.Meta(max_length=2 * _DIGEST_BYTES)]  # keyed blake2b of the payload, hex


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(DiskHeader)


def file_name(mm_hash: str) -> str:
    """The file an mm_hash is kept in: a hash of it (any string a hash may be stays out of the path)."""
    return hashlib.blake2b(mm_hash.encode(), digest_size=20).hexdigest() + SUFFIX


def file_key(internal_key: str | None) -> bytes:
    """The tier's MAC key: HMAC-SHA256 of a fixed domain under the internal key (so the key itself is never used
    as is, nor this one anywhere else); empty without an internal key (--insecure: checksums only)."""
    if not internal_key:
        return b""
    return hmac.new(internal_key.encode(), _KEY_DOMAIN, hashlib.sha256).digest()


def _mac(key: bytes, person: bytes, buffers: Sequence[bytes | memoryview]) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES, key=key, person=person)
    for buf in buffers:
        h.update(buf)
    return h.digest()


def encode_file(fingerprint: str, mm_hash: str, features: ImageFeatures, key: bytes) -> list[bytes | memoryview]:
    """What to write, in order: magic, length, MAC and header, then the tensors' bytes (no copy of them)."""
    wire = WireItem(features)
    buffers = wire.buffers
    digest = _mac(key, _PAYLOAD_PERSON, buffers).hex()
    header = DiskHeader(fingerprint=fingerprint, item=wire.item(mm_hash, 0),
                        payload_bytes=sum(buf.nbytes for buf in buffers), digest=digest)
    return [encode_head(header, key), *buffers]


def encode_head(header: DiskHeader, key: bytes) -> bytes:
    """Magic, length, the header's MAC under `key`, and the header."""
    head = _ENCODER.encode(header)
    mac = _mac(key, _HEADER_PERSON, [MAGIC, len(head).to_bytes(4, "little"), head])
    return _PREFIX.pack(MAGIC, len(head), mac) + head


def read_header(fd: int, file_size: int, fingerprint: str, max_bytes: int, key: bytes) -> tuple[DiskHeader, int]:
    """The header of an open file and where its payload starts; DiskFormatError when the file is not a whole
    embedding of `fingerprint` of at most `max_bytes` payload bytes whose header was written under `key`."""
    prefix = os.pread(fd, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        raise DiskFormatError(f"{file_size} bytes: shorter than the {_PREFIX.size}-byte prefix")
    magic, head_len, mac = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise DiskFormatError(f"not an embedding file of this format (magic {magic!r})")
    start = _PREFIX.size + head_len
    if head_len > MAX_HEADER_BYTES or start > file_size:
        raise DiskFormatError(f"header of {head_len} bytes in a file of {file_size}")
    head = os.pread(fd, head_len, _PREFIX.size)
    if len(head) != head_len:
        raise DiskFormatError("truncated header")
    if not hmac.compare_digest(mac, _mac(key, _HEADER_PERSON, [magic, head_len.to_bytes(4, "little"), head])):
        raise DiskFormatError("its header MAC does not match: not written under this encoder's key (another "
                              "user's file, another internal key) or altered")
    try:
        header = _DECODER.decode(head)
    except msgspec.DecodeError as e:
        raise DiskFormatError(f"bad header: {e}") from None
    if header.fingerprint != fingerprint:
        raise DiskFormatError(f"written for model fingerprint {header.fingerprint[:32]!r}, not {fingerprint!r}")
    item = header.item
    if not item.found or item.dtype is None or item.shape is None or item.frame != 0 or item.shm is not None:
        raise DiskFormatError("the header describes no tensor")
    try:
        main = tensor_nbytes(item.dtype, item.shape, max_bytes)
        deep = 0 if item.deepstack_shape is None else tensor_nbytes(item.dtype, item.deepstack_shape, max_bytes)
    except WireError as e:
        raise DiskFormatError(str(e)) from None
    if main + deep != header.payload_bytes or main + deep > max_bytes:
        raise DiskFormatError(f"declares {header.payload_bytes} payload bytes, its shapes {main} + {deep} "
                              f"(cap {max_bytes})")
    if start + header.payload_bytes != file_size:
        raise DiskFormatError(f"the file holds {file_size - start} bytes after the header, not the "
                              f"{header.payload_bytes} it declares")
    return header, start


def read_features(fd: int, header: DiskHeader, start: int, key: bytes) -> ImageFeatures:
    """Read the payload, check its keyed digest and build the item's tensors over it (one copy, from the file)."""
    payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
    view = memoryview(payload.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol
    got = os.preadv(fd, [view], start) if header.payload_bytes else 0
    if got != header.payload_bytes:
        raise DiskFormatError(f"read {got} of {header.payload_bytes} payload bytes")
    item = header.item
    main = tensor_nbytes(item.dtype or "uint8", item.shape or [], header.payload_bytes)
    buffers = [view[:main], view[main:]]
    if not hmac.compare_digest(_mac(key, _PAYLOAD_PERSON, buffers).hex(), header.digest):
        raise DiskFormatError("the payload does not match its digest")
    try:
        found, _ = read_get_reply(GetReply(req_id=0, items=[item]), buffers if item.deepstack_frame else buffers[:1],
                                  None)
    except (WireError, ValueError, IndexError) as e:
        raise DiskFormatError(f"the header's item does not hold together: {e}") from None
    if item.mm_hash not in found:
        raise DiskFormatError("the header's item was not read")
    return found[item.mm_hash]
