"""Same-host shared memory for embeddings: one anonymous memfd segment per held item, mapped by consumers.

A producer places an item's bytes once in a segment [16-byte random tag][embeds][deepstack] (`Segment.place`);
its cached tensors are views over that mapping, so the socket path sends from the same memory. A consumer on the
same host (same uid, same pid namespace) maps the segment through `/proc/<producer pid>/fd/<fd>` with
MAP_PRIVATE (copy on write: torch gets a writable buffer and no byte is copied) and checks the tag, because fd
numbers are reused after an eviction and a stale handle must never read another item's bytes.

Nothing is named in /dev/shm: the pages belong to the fd and to the mappings, so the kernel frees them when the
last of those goes, whichever process dies (kill -9 included). The segments are sealed against shrinking, so a
mapping can never fault (SIGBUS) on a truncated file; `posix_fallocate` reserves the pages up front, so a full
memory is an error when an item is stored (it then stays on the heap and travels by socket), never later.
"""
from __future__ import annotations

import fcntl
import hmac
import logging
import mmap
import os
import resource
import secrets
import stat
import weakref

import torch

from connector.tensors.frames import DTYPES
from epd_contracts.ec import SHM_TAG_BYTES, ShmHandle
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

NAME = "epd-ec"  # what /proc/<pid>/maps and /proc/<pid>/fd show: "/memfd:epd-ec (deleted)"
_LINK_PREFIX = f"/memfd:{NAME}"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ShmError(Exception):
    """A shared-memory handle that cannot be used (the item then travels by socket)."""


class Segment:
    """A producer's memfd segment: the fd (what consumers open) and a shared read-write mapping.

    `close()` drops the fd at once; the mapping is never closed explicitly: it goes when no tensor or buffer views
    it any more (a socket send in flight, a caller still holding the features), so eviction never pulls memory
    from under a reader.
    """

    def __init__(self, payload_bytes: int) -> None:
        """Reserve SHM_TAG_BYTES + `payload_bytes` bytes; OSError (ENOSPC, ENOMEM, EMFILE...) when it cannot."""
        self.size = SHM_TAG_BYTES + payload_bytes
        self.tag = secrets.token_bytes(SHM_TAG_BYTES)
        fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(fd, 0, self.size)  # pages reserved now: full is ENOSPC here, not SIGBUS later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # the size is fixed for every mapping's lifetime
            mapping = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        mapping[:SHM_TAG_BYTES] = self.tag
        self._map: mmap.mmap | None = mapping
        self.fd: int | None = fd
        self._close_fd = weakref.finalize(self, os.close, fd)  # also when a segment is dropped without close()

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over the mapping at `offset` past the tag (no copy)."""
        assert self._map is not None, "segment closed"
        return _view(self._map, SHM_TAG_BYTES + offset, dtype, shape)

    def handle(self) -> ShmHandle:
        assert self.fd is not None, "segment closed"
        return ShmHandle(pid=os.getpid(), fd=self.fd, tag=self.tag, size=self.size)

    def close(self) -> None:
        """Close the fd (idempotent); the pages live on while a view of the mapping or a consumer's mapping does."""
        self.fd = None
        self._close_fd()  # a finalizer runs once
        self._map = None  # unmapped now if nothing views it, else when the last view goes

    @classmethod
    def place(cls, features: ImageFeatures) -> tuple[Segment, ImageFeatures]:
        """Copy an item's tensors into a new segment (from any device, once) and return it with features over it."""
        embeds, deepstack = features.embeds, features.deepstack
        main = int(embeds.numel()) * embeds.element_size()
        extra = 0 if deepstack is None else int(deepstack.numel()) * deepstack.element_size()
        segment = cls(main + extra)
        try:
            placed = segment.tensor(0, embeds.dtype, tuple(embeds.shape))
            placed.copy_(embeds.detach())
            placed_deep = None
            if deepstack is not None:
                placed_deep = segment.tensor(main, deepstack.dtype, tuple(deepstack.shape))
                placed_deep.copy_(deepstack.detach())
        except BaseException:
            segment.close()
            raise
        return segment, features.with_tensors(placed, placed_deep)


def open_handle(handle: ShmHandle, pid: int, payload_bytes: int) -> mmap.mmap:
    """Map a producer's segment copy-on-write and check it; ShmError for anything wrong, nothing left open.

    `pid`: the producer this consumer probed (a handle naming another process is refused before any open);
    `payload_bytes`: what the item's dtype and shape need (checked already), so the size is never trusted alone.
    """
    if handle.pid != pid:
        raise ShmError(f"handle names pid {handle.pid}, the producer probed was {pid}")
    if handle.size != SHM_TAG_BYTES + payload_bytes:
        raise ShmError(f"handle declares {handle.size} bytes, the item needs {SHM_TAG_BYTES + payload_bytes}")
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        if not os.readlink(path).startswith(_LINK_PREFIX):  # never open another kind of file (a FIFO, a device)
            raise ShmError(f"{path} is not an {NAME} segment")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ShmError(f"cannot open {path}: {e.strerror}") from None
    try:
        return _map_checked(fd, handle)
    finally:
        os.close(fd)


def _map_checked(fd: int, handle: ShmHandle) -> mmap.mmap:
    """Check the opened file (still a sealed memfd of the declared size), map it and check the tag."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(_LINK_PREFIX):  # the fd may have been reused
            raise ShmError("the handle's fd is no longer a segment")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != handle.size:
            raise ShmError(f"segment has {st.st_size} bytes, handle declares {handle.size}")
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise ShmError("segment is not sealed against shrinking")
        mapping = mmap.mmap(fd, handle.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise ShmError(f"cannot map the segment: {e.strerror}") from None
    if not hmac.compare_digest(mapping[:SHM_TAG_BYTES], handle.tag):
        mapping.close()
        raise ShmError("segment tag does not match the handle (stale handle: its fd was reused)")
    return mapping


def mapped_tensor(mapping: mmap.mmap, offset: int, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over a consumer's mapping at `offset` past the tag (writable, copy on write; no copy now)."""
    return _view(mapping, SHM_TAG_BYTES + offset, DTYPES[dtype], tuple(shape))


def _view(buf: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # NOTE: torch.frombuffer keeps a reference to the object it is given, not a buffer export; given a memoryview,
    # the mapping is exported while the tensor lives, so a stray mmap.close() raises instead of unmapping it.
    count = 1
    for dim in shape:
        count *= dim
    if count == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer rejects empty views
    return torch.frombuffer(memoryview(buf), dtype=dtype, count=count, offset=offset).view(shape)


def raise_fd_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit: a producer holds one fd per cached item."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
