"""Same-host shared memory for embeddings and K/V hand-offs: one anonymous memfd segment per held item, mapped by
consumers.

A producer places an item's bytes once in a segment [16-byte random tag][embeds][deepstack] (`Segment.place`; a
prefill worker's hand-off: [tag][blocks], connector/tensors/kv_store.py); its held tensors are views over that
mapping, so the socket path sends from the same memory. A consumer on the
same host (same uid, same pid namespace) maps the segment through `/proc/<producer pid>/fd/<fd>` with
MAP_PRIVATE (copy on write: torch gets a writable buffer and no byte is copied) and checks the tag, because fd
numbers are reused after an eviction and a stale handle must never read another item's bytes.

Nothing is named in /dev/shm: the pages belong to the fd and to the mappings, so the kernel frees them when the
last of those goes, whichever process dies (kill -9 included). The segments are sealed against shrinking, so a
mapping can never fault (SIGBUS) on a truncated file; `posix_fallocate` reserves the pages up front, so a full
memory is an error when an item is stored (it then stays on the heap and travels by socket), never later.

Once filled, a segment is sealed against writes (F_SEAL_WRITE and F_SEAL_SEAL): the producer writes through a
shared mapping it then unmaps, since the kernel refuses the seal (EBUSY) while anyone holds a writable shared
mapping. After the seal nobody (the producer included) can write(2) it, punch holes in it or map it writable
(EPERM), and the producer checks that it holds exactly the bytes it wrote, so a process of the same user that
opened `/proc/<producer>/fd/<fd>` before the seal is caught either way (that item stays on the heap). The
producer's own views are a copy-on-write mapping like the consumers'. A consumer maps only a segment that carries
the seals it relies on (`REQUIRED_SEALS`), so a segment sealed less is never trusted.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import logging
import mmap
import os
import resource
import secrets
import stat
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from connector.tensors.dtypes import DTYPES
from epd_contracts.ec import SHM_TAG_BYTES, ShmHandle
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

# items smaller than this stay on the heap and go by socket: opening and mapping a segment (~65 us of syscalls)
# costs about what sending 64 KiB does (docs/BENCHMARKS.md, "EC connector vs raw ZeroMQ")
SHM_MIN_BYTES = 128 << 10

NAME = "epd-ec"  # what /proc/<pid>/maps and /proc/<pid>/fd show: "/memfd:epd-ec (deleted)"
_LINK_PREFIX = f"/memfd:{NAME}"
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # at creation: the size is fixed for every mapping
FILLED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL  # once filled: no write by anyone, and no seal changes
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE  # what a consumer checks before it trusts a segment


class ShmError(Exception):
    """A shared-memory handle that cannot be used (the item then travels by socket)."""


class Segment:
    """A producer's memfd segment, sealed once filled: the fd (what consumers open) and a copy-on-write mapping.

    `close()` drops the fd at once; the mapping is never closed explicitly: it goes when no tensor or buffer views
    it any more (a socket send in flight, a caller still holding the features), so eviction never pulls memory
    from under a reader.
    """

    def __init__(self, payload_bytes: int, contents: Sequence[torch.Tensor] = ()) -> None:
        """Reserve SHM_TAG_BYTES + `payload_bytes` bytes, write the tag and `contents` (back to back, from any
        device) and seal the segment; OSError (ENOSPC, ENOMEM, EMFILE, EBUSY: a writable mapping elsewhere...)
        when it cannot."""
        self.size = SHM_TAG_BYTES + payload_bytes
        self.tag = secrets.token_bytes(SHM_TAG_BYTES)
        fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(fd, 0, self.size)  # pages reserved now: full is ENOSPC here, not SIGBUS later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
            _fill(fd, self.size, self.tag, contents)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FILLED_SEALS)  # EBUSY while any writable shared mapping exists
            # NOTE: copy on write, as a consumer maps it: torch wants a writable buffer, the segment stays unchanged
            mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if not _holds(mapping, self.tag, contents):  # sealed now: what it holds is what every reader gets
                raise OSError(errno.EIO, "the segment was written to before it was sealed")
        except BaseException:
            os.close(fd)
            raise
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
        segment = cls(main + extra, [embeds] if deepstack is None else [embeds, deepstack])
        placed = segment.tensor(0, embeds.dtype, tuple(embeds.shape))
        placed_deep = None if deepstack is None else segment.tensor(main, deepstack.dtype, tuple(deepstack.shape))
        return segment, features.with_tensors(placed, placed_deep)


def _fill(fd: int, size: int, tag: bytes, contents: Sequence[torch.Tensor]) -> None:
    """Write the tag and the tensors through a shared mapping, unmapped before returning (the write seal needs it)."""
    writer = mmap.mmap(fd, size)
    try:
        writer[:SHM_TAG_BYTES] = tag
        offset = SHM_TAG_BYTES
        for t in contents:
            _copy_into(writer, offset, t)
            offset += int(t.numel()) * t.element_size()
    finally:
        with contextlib.suppress(BufferError):  # only after a failed copy, whose traceback still views it
            writer.close()


def _copy_into(writer: mmap.mmap, offset: int, t: torch.Tensor) -> None:
    _view(writer, offset, t.dtype, tuple(t.shape)).copy_(t.detach())  # the view dies here: nothing exports `writer`


def _holds(mapping: mmap.mmap, tag: bytes, contents: Sequence[torch.Tensor]) -> bool:
    """Whether a sealed segment holds exactly the tag and `contents`, bit for bit: a write by another process
    between the fill and the seal (write(2), or a mapping unmapped again before the seal) is caught here."""
    if mapping[:SHM_TAG_BYTES] != tag:
        return False
    offset = SHM_TAG_BYTES
    for t in contents:
        source = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        # NOTE: numpy compares bytes about 9x faster than torch.equal on uint8 (about 3 copies' time)
        if not np.array_equal(np.frombuffer(mapping, np.uint8, source.size, offset), source):
            return False
        offset += source.size
    return True


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
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS != REQUIRED_SEALS:
            raise ShmError("segment is not sealed against writes and shrinking")
        mapping = mmap.mmap(fd, handle.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise ShmError(f"cannot map the segment: {e.strerror}") from None
    except (ValueError, OverflowError) as e:  # mmap's own checks (a length past the file): never past this point
        raise ShmError(f"cannot map the segment: {e}") from None
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


def open_probe(what: str) -> Segment | None:
    """The probe segment consumers check they can map before asking for handles (None: memfd unavailable here, and
    `what` go by socket only); the open-file limit is raised first, as a producer holds one fd per segment."""
    raise_fd_limit()
    try:
        return Segment(0)
    except OSError as e:
        logger.warning("shared memory unavailable (%s); %s go by socket only", e, what)
        return None


def probed_pid(handle: ShmHandle | None) -> int:
    """The pid of a producer whose probe segment (`handle`, from its ShmProbeReply) this process maps, the tag
    checked; ShmError when there is none or it cannot be mapped (another host, pid namespace or user)."""
    if handle is None:
        raise ShmError("the producer holds no shared memory")
    open_handle(handle, handle.pid, 0).close()
    return handle.pid


def raise_fd_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit: a producer holds one fd per cached item."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
