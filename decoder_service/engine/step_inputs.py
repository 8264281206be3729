"""A step's inputs: the rows and segments a forward runs, and what it is handed (packed embeddings and positions, the
paged attention's plan: slot mapping, block tables, masks per group of rows).

Host work of every step, so it is kept lean: index tensors go through machine arrays (`int_tensor`), block tables
through one flat list, and the decode rows share one group (one block table, one mask)."""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from decoder_service.engine.prefix_hash import PrefixChain
from decoder_service.engine.step_plan import Group, StepPlan, causal_mask, int_tensor
from decoder_service.engine.work import Prompt
from epd_models.base import FamilyAdapter
from epd_models.halves import LanguageHalf

DECODE_SPLIT_BLOCKS = 8  # CPU: a decode row this many blocks longer than its group's first (and twice as long) splits


@dataclass(slots=True)
class Row:
    key: Hashable
    prompt: Prompt
    embeds: torch.Tensor  # (1, T, hidden): the prompt's embeddings (images merged), then any fed tokens'
    positions: torch.Tensor  # (1, T), or (3, 1, T) for M-RoPE
    rope_delta: int
    target: int  # positions to prefill: the prompt, plus the tokens a preempted row had fed
    state: Any = None  # the family's per-prompt prefill state (FamilyAdapter.prefill_state), None for most
    length: int = 0  # positions written
    blocks: list[int] = field(default_factory=list)
    forks: list[Hashable] = field(default_factory=list)  # rows that copy its K/V once prefilled
    fork_blocks: list[int] = field(default_factory=list)  # their last, partial prompt block, reserved
    chain: PrefixChain | None = None  # the prompt's prefix-cache keys (None: not cached)
    route_keys: tuple[str, ...] = ()
    fed: tuple[int, ...] = ()  # a preempted row's tokens fed back before it was preempted (prefilled again)
    resumed: bool = False  # a preempted row prefilling again: its last logits are not a new token's

    @property
    def prefilled(self) -> bool:
        return self.length >= self.target


@dataclass(slots=True)
class Segment:
    row: Row
    start: int
    num: int
    decode: bool  # a prefilled row's one fed token (else a prompt chunk, or a verification)
    feed: tuple[int, ...] = ()  # a verification (speculative decoding): the fed token, then the drafts


class StepInputs:
    """Builds each forward's inputs for one language model and block size."""

    def __init__(self, lm: LanguageHalf, block_size: int):
        self.lm, self.block_size = lm, block_size
        probe = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=lm.device)
        self._mask_shape = lm.adapter.attention_mask(lm.config, probe, [0], [None])  # what transformers is passed
        self._position_lead = tuple(lm.adapter.decode_position_ids(0, 0).shape[:-1])
        self.split_decode = lm.device.type == "cpu"  # decode_runs
        # the family's mask is the plain causal one: CPU decode rows may go through the in-place kernel
        self.plain_causal = self.split_decode and type(lm.adapter).attention_mask is FamilyAdapter.attention_mask
        self.in_place = False  # the kernel reads the rows (ModelRunner.use_decode_kernel): one group, see plan()

    def plan(self, segments: list[Segment], tokens: dict[Hashable, int]) -> tuple[StepPlan, torch.Tensor, torch.Tensor]:
        """The forward's plan (slot mapping, block tables and masks per group), its packed embeddings and positions:
        decode rows first (the tokens fed back), then each prefill chunk."""
        b, dev = self.block_size, self.lm.device
        slots: list[int] = []
        embeds: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        plan = StepPlan(torch.empty(0))
        decode = [s for s in segments if s.decode]
        if decode:
            ids = int_tensor([tokens[s.row.key] for s in decode]).view(1, -1)
            embeds.append(self.lm.embed(ids, []))
            positions.append(self.decode_positions([s.start + s.row.rope_delta for s in decode]))
            slots += [s.row.blocks[s.start // b] * b + s.start % b for s in decode]
            first = 0
            for run in self.decode_runs(decode) if not self.in_place else []:
                plan.groups.append(self.group([s.row for s in run], [s.start for s in run], 1, first, True))
                first += len(run)
        if self.in_place:  # every decode row and every verification query (a row each), packed in this order
            verify = [s for s in segments if s.feed]
            rows = [s.row for s in decode] + [s.row for s in verify for _ in range(s.num)]
            if rows:
                plan.groups.append(self.group(rows, [s.start for s in decode] + [p for s in verify
                                                    for p in range(s.start, s.start + s.num)], 1, 0, True))
        first = len(decode)
        for s in segments:
            if s.decode:
                continue
            row, end = s.row, s.start + s.num
            if s.feed:  # a verification: the fed token and the drafts, at the positions decoding gives them
                embeds.append(self.lm.embed(int_tensor(s.feed).view(1, -1), []))
                positions.append(self.decode_positions([p + row.rope_delta for p in range(s.start, end)]))
            else:
                embeds.append(row.embeds[:, s.start : end])
                positions.append(row.positions[..., s.start : end])
            slots += [row.blocks[p // b] * b + p % b for p in range(s.start, end)]
            if not (s.feed and self.in_place):
                plan.groups.append(self.group([row], [s.start], s.num, first, False))
            first += s.num
        plan.slots = int_tensor(slots).to(dev, non_blocking=True)
        plan.seq_len = max(s.start for s in segments)
        return plan, torch.cat(embeds, dim=1), torch.cat(positions, dim=-1)

    def decode_runs(self, decode: list[Segment]) -> list[list[Segment]]:
        """The decode rows' attention groups. CUDA: one (varlen attention reads each row's own length, and a CUDA
        graph replays a one-group step). CPU: the rows come sorted by length (ModelRunner._decode_segments), and a
        row more than twice as long as its group's first, and longer by at least DECODE_SPLIT_BLOCKS blocks, starts
        a new group: one long row would otherwise make every short row gather and attend over its length (a row of
        1,500 positions among rows of 100 made each step about twice as slow)."""
        if not self.split_decode:
            return [decode]
        runs: list[list[Segment]] = []
        for s in decode:
            if runs and not (s.start > 2 * runs[-1][0].start and
                             s.start - runs[-1][0].start >= DECODE_SPLIT_BLOCKS * self.block_size):
                runs[-1].append(s)
            else:
                runs.append([s])
        return runs

    def decode_positions(self, values: list[int]) -> torch.Tensor:
        """Every decode row's position in one tensor, shaped as the family's (`decode_position_ids` fills its
        (1, 1), or M-RoPE's (3, 1, 1), with past + delta)."""
        flat = int_tensor(values).view(*([1] * (len(self._position_lead) - 1)), 1, -1)
        return self.lm.to_device(flat.expand(*self._position_lead, len(values)))

    def group(self, rows: list[Row], starts: list[int], num_new: int, first: int, decode: bool) -> Group:
        b, dev = self.block_size, self.lm.device
        kv_len = max(starts) + num_new
        width = -(-kv_len // b)
        flat: list[int] = []  # one flat list, one machine array: 8x faster than torch.tensor of nested lists
        for r in rows:
            flat += r.blocks if len(r.blocks) <= width else r.blocks[:width]
            flat += [0] * (width - len(r.blocks))  # the null block pads short rows
        table = int_tensor(flat).view(len(rows), width).to(dev, non_blocking=True)
        mask = self.lm.adapter.attention_mask(self.lm.config, causal_mask(starts, num_new, dev), starts,
                                              [r.state for r in rows])
        lens = [s + num_new for s in starts]
        return Group(table, kv_len, mask, first, len(rows) if decode else num_new, decode, [r.key for r in rows],
                     lens, int_tensor(lens) if decode and self.plain_causal else None)

    def dummy_mask(self, embeds: torch.Tensor) -> Any:
        """What transformers is handed as attention_mask (a 4D mask it passes through untouched); the real masks
        are the plan's, per segment group."""
        dummy = torch.ones(1, 1, embeds.shape[1], 1, dtype=torch.bool, device=embeds.device)
        return {k: dummy for k in self._mask_shape} if isinstance(self._mask_shape, dict) else dummy
