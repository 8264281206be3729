"""What rank 0 sends the other ranks: one msgspec message per operation over each rank's socket (no pickle), and a
forward's tensors as one byte buffer broadcast over the process group.

The socket carries the operations in order (a rank waits there, without a timeout, while the decoder is idle; its end
of file means rank 0 is gone). A forward's message describes its tensors (dtype, shape, offset into the buffer: each
starts on an 8-byte boundary) and the step's plan (groups, their block tables and masks by index); the buffer itself
goes by one `broadcast`, so the bytes ride the collective's transport (NCCL on CUDA, gloo on the CPU)."""
from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec
import torch

from decoder_service.engine.step_plan import Group, StepPlan

_ALIGN = 8
_LEN = struct.Struct("!I")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                                     torch.int32, torch.bool, torch.uint8)}


class TensorSpec(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    offset: int


class GroupSpec(msgspec.Struct, array_like=True):
    table: int
    kv_len: int
    mask: int | dict[str, int]
    first: int
    num_q: int
    decode: bool
    lens: list[int] | None


class Forward(msgspec.Struct, tag=True):
    nbytes: int
    tensors: list[TensorSpec]
    slots: int
    embeds: int
    positions: int
    seq_len: int
    groups: list[GroupSpec]
    extra: dict[str, int | list[int]]  # a tensor, or a list of tensors, by index


class OpenPool(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int


class Zero(msgspec.Struct, tag=True):
    blocks: list[int]


class CopyBlock(msgspec.Struct, tag=True):
    src: int
    dst: int


class Scatter(msgspec.Struct, tag=True):
    """Received blocks (a hand-off): each rank takes its K/V heads by `scatter` and writes them into `blocks`."""

    blocks: list[int]
    first_position: int
    num_tokens: int
    shape: list[int]
    dtype: str


class Gather(msgspec.Struct, tag=True):
    """Blocks handed off: each rank's heads of `blocks` go to rank 0 by `gather`."""

    blocks: list[int]


class Stop(msgspec.Struct, tag=True):
    pass


class Join(msgspec.Struct, tag=True):
    """Every rank loaded: join the process group now (each rank's rendezvous then waits seconds, not a load)."""


class Ready(msgspec.Struct, tag=True):
    rank: int


class Failed(msgspec.Struct, tag=True):
    rank: int
    reason: str


Message = Forward | OpenPool | Zero | CopyBlock | Scatter | Gather | Stop | Join | Ready | Failed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def send(sock: socket.socket, msg: Message) -> None:
    body = _encoder.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv(sock: socket.socket) -> Message | None:
    """The next message, or None at end of file (the other end closed or died)."""
    head = _read(sock, _LEN.size)
    if head is None:
        return None
    body = _read(sock, _LEN.unpack(head)[0])
    return None if body is None else _decoder.decode(body)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


class Packer:
    """Tensors into one byte buffer (each at an 8-byte boundary), by index."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.specs: list[TensorSpec] = []
        self.nbytes = 0

    def add(self, t: torch.Tensor) -> int:
        t = t.contiguous()
        self.specs.append(TensorSpec(str(t.dtype).removeprefix("torch."), list(t.shape), self.nbytes))
        raw = t.reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        self.parts.append(raw if not pad else torch.cat([raw, raw.new_zeros(pad)]))
        self.nbytes += raw.numel() + pad
        return len(self.specs) - 1

    def buffer(self, device: torch.device) -> torch.Tensor:
        if not self.parts:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return torch.cat([p.to(device, non_blocking=True) for p in self.parts])


def unpack(buf: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    out = []
    for s in specs:
        dtype = _DTYPES[s.dtype]
        n = int(torch.tensor(s.shape, dtype=torch.int64).prod()) * torch.empty((), dtype=dtype).element_size()
        out.append(buf[s.offset : s.offset + n].view(dtype).view(s.shape))
    return out


def forward_message(plan: StepPlan, embeds: torch.Tensor, positions: torch.Tensor,
                    extra: dict[str, Any]) -> tuple[Forward, Packer]:
    """A forward's message and its packed tensors (the plan's masks, tables and slots; embeddings; extras)."""
    pack = Packer()
    groups = []
    for g in plan.groups:
        mask = {k: pack.add(m) for k, m in g.mask.items()} if isinstance(g.mask, dict) else pack.add(g.mask)
        groups.append(GroupSpec(pack.add(g.table), g.kv_len, mask, g.first, g.num_q, g.decode, g.lens))
    extras: dict[str, int | list[int]] = {}
    for k, v in extra.items():
        extras[k] = [pack.add(t) for t in v] if isinstance(v, (list, tuple)) else pack.add(v)
    msg = Forward(0, pack.specs, pack.add(plan.slots), pack.add(embeds), pack.add(positions), plan.seq_len, groups,
                  extras)
    msg.nbytes = pack.nbytes
    return msg, pack


def forward_inputs(msg: Forward, buf: torch.Tensor) -> tuple[StepPlan, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The plan, embeddings, positions and extras rank 0 packed (views of `buf`)."""
    t = unpack(buf, msg.tensors)
    plan = StepPlan(t[msg.slots], seq_len=msg.seq_len)
    for g in msg.groups:
        mask = {k: t[i] for k, i in g.mask.items()} if isinstance(g.mask, dict) else t[g.mask]
        plan.groups.append(Group(t[g.table], g.kv_len, mask, g.first, g.num_q, g.decode, lens=g.lens))
    extra = {k: [t[i] for i in v] if isinstance(v, list) else t[v] for k, v in msg.extra.items()}
    return plan, t[msg.embeds], t[msg.positions], extra
