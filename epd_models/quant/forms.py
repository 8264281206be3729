"""The two forms every served format is read into: FP8 weights with a scale per block (a per-channel scale is a
block of one row), and 4-bit integers with a scale and a zero per group of input columns. A form dequantizes
(the CPU path, and the twin a test compares with) and says how many bytes it holds."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Weight:
    """W[i, j] = float(q[i, j]) * scale[i // rows, j // cols] (fp32 arithmetic)."""

    q: torch.Tensor  # (out, in) float8_e4m3fn
    scale: torch.Tensor  # (ceil(out / rows), ceil(in / cols)) float32
    block: tuple[int, int]  # (rows, cols)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.block
        out, inn = self.q.shape
        scale = self.scale.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inn]
        return (self.q.float() * scale).to(dtype)

    @property
    def held_bytes(self) -> int:
        return fp8_bytes(self.q.shape[0], self.q.shape[1], self.block)


@dataclass(frozen=True)
class Int4Weight:
    """W[o, i] = (q[o, i] - zero[o, g]) * scale[o, g] with g = groups[i] (fp32 arithmetic); q in 0..15."""

    q: torch.Tensor  # (out, in) uint8, one value per byte (the kernels repack it)
    scale: torch.Tensor  # (out, num_groups) float32
    zero: torch.Tensor  # (out, num_groups) float32, in units of q
    groups: torch.Tensor  # (in,) int64: each input column's group (GPTQ's g_idx; i // group_size elsewhere)
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def contiguous_groups(self) -> bool:
        """Column i in group i // group_size: what the int4 kernels take (GPTQ with act-order is not)."""
        expected = torch.arange(self.q.shape[1]) // self.group_size
        return bool(torch.equal(self.groups.cpu(), expected))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        scale, zero = self.scale.float()[:, self.groups], self.zero.float()[:, self.groups]
        return ((self.q.float() - zero) * scale).to(dtype)

    @property
    def held_bytes(self) -> int:
        return int4_bytes(self.q.shape[0], self.q.shape[1], self.group_size)


Form = Fp8Weight | Int4Weight


def fp8_bytes(out: int, inn: int, block: tuple[int, int]) -> int:
    """What an FP8 linear holds kept quantized: a byte per weight and a float32 scale per block (a per-channel
    scale is a block of one row)."""
    rows, cols = block
    return out * inn + 4 * -(-out // rows) * -(-inn // (cols or inn))


def int4_bytes(out: int, inn: int, group: int) -> int:
    """What an int4 linear holds kept quantized: two weights per byte, a bf16 scale and zero per group and row
    (tinygemm's layout)."""
    return out * inn // 2 + 4 * out * -(-inn // group)


def unpack_nibbles(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (0..15, uint8) along `dim`; word bits 4k..4k+3 hold the value at
    position order[k] of its eight (AWQ's interleaved order; 0..7 elsewhere)."""
    words = packed.to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    moved = words.movedim(dim, -1)
    nibbles = (moved.unsqueeze(-1) >> shifts) & 0xF  # (..., words, 8): nibble k of each word
    place = torch.empty(8, dtype=torch.long)
    place[list(order)] = torch.arange(8)
    nibbles = nibbles[..., place]  # position p holds nibble k where order[k] == p
    return nibbles.flatten(-2).movedim(-1, dim).to(torch.uint8)
