"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket, replayed with the step's inputs.

A decode step's host cost (Python, transformers' module calls, one kernel launch each) does not grow with the
weights; replaying a captured graph launches the whole forward at once. As in vLLM:
- Buckets (`buckets`): 1, 2, 4, 8, then steps of 8, up to the first that holds max_num_seqs rows, at most 512. A
  step of n rows replays the smallest bucket >= n (`bucket_for`); a step with more rows, any step with a prefill
  chunk, `--enforce-eager`, or a kernel that cannot page this block size (cuda_attention.paged_supported) runs
  eagerly.
- Static inputs (`StaticInputs`), one set sized for the largest bucket, each bucket capturing views of its first
  rows: embeddings (the ids are embedded eagerly), positions (M-RoPE's 3 rows too), slot mapping, block tables as
  wide as max_model_len (so the graph's max_k is static), the positions each row reads, and cu_seq_q / cu_seq_k.
- Padding (`StaticInputs.fill`): rows n..bucket write their K/V into slot 0 (`PAD_SLOT`, the null block's first
  position), read that one position (seqused_k 1) through an all-null block table, from zero embeddings at
  position 0; the graph zeroes block 0 again after the forward, so the null block stays zero for every reader.
  Their logits are dropped.
- Capture (`DecodeGraphs.capture`): largest bucket first, into one shared memory pool, each after an eager
  warm-up on a side stream (torch.cuda.graphs' documented recipe); sampling stays outside the graph.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from decoder_service.engine.cuda_attention import HALF, VarlenMeta, paged_supported, row_lengths
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.step_plan import Group, StepPlan

if TYPE_CHECKING:
    from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
MAX_BUCKET = 512  # vLLM's largest captured batch
PAD_SLOT = 0  # where padding rows write their K/V: block 0 (the null block), zeroed again by the graph
Forward = Callable[[torch.Tensor, torch.Tensor, StepPlan], torch.Tensor]  # (embeds, positions, plan) -> logits


def buckets(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, ... up to the first >= max_num_seqs (at most 512)."""
    out: list[int] = []
    for size in [1, 2, 4, *range(8, MAX_BUCKET + 1, 8)]:
        out.append(size)
        if size >= max_num_seqs:
            break
    return out


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `rows` (None: more rows than any bucket, run eagerly)."""
    return next((b for b in sizes if b >= rows), None)


@dataclass
class StaticInputs:
    """The captured graphs' inputs, sized for the largest bucket (a bucket's graph reads its first rows)."""

    embeds: torch.Tensor  # (1, rows, hidden)
    positions: torch.Tensor  # (..., rows): (1, rows), or (3, 1, rows) for M-RoPE
    slots: torch.Tensor  # (rows,) int64: where each row's new K/V goes
    table: torch.Tensor  # (rows, max_blocks) int32 block ids, 0-padded
    used: torch.Tensor  # (rows,) int32: positions each row reads, its new one included
    cu_q: torch.Tensor  # (rows + 1,) int32: 0, 1, 2, ... (one query a row)
    cu_k: torch.Tensor  # (rows + 1,) int32: cumulative `used`, computed inside the graph

    @classmethod
    def empty(cls, rows: int, hidden: int, position_dims: tuple[int, ...], max_blocks: int, dtype: torch.dtype,
              device: torch.device) -> StaticInputs:
        i32 = torch.int32
        return cls(torch.zeros(1, rows, hidden, dtype=dtype, device=device),
                   torch.zeros(*position_dims, rows, dtype=torch.long, device=device),
                   torch.full((rows,), PAD_SLOT, dtype=torch.long, device=device),
                   torch.zeros(rows, max_blocks, dtype=i32, device=device), torch.ones(rows, dtype=i32, device=device),
                   torch.arange(rows + 1, dtype=i32, device=device), torch.zeros(rows + 1, dtype=i32, device=device))

    def fill(self, bucket: int, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             table: torch.Tensor, used: torch.Tensor) -> None:
        """Copy a step of n rows in, and make rows n..bucket padding (device copies, no sync)."""
        n, width = table.shape
        self.embeds[:, :n].copy_(embeds, non_blocking=True)
        self.embeds[:, n:bucket].zero_()
        self.positions[..., :n].copy_(positions, non_blocking=True)
        self.positions[..., n:bucket].zero_()
        self.slots[:n].copy_(slots, non_blocking=True)
        self.slots[n:bucket].fill_(PAD_SLOT)
        self.table[:n, :width].copy_(table, non_blocking=True)
        self.table[:n, width:].zero_()  # never read (past `used`), zeroed so a table never names stale blocks
        self.table[n:bucket].zero_()
        self.used[:n].copy_(used, non_blocking=True)
        self.used[n:bucket].fill_(1)

    def plan(self, bucket: int, block_size: int, mask: torch.Tensor | None) -> StepPlan:
        """The decode plan a bucket's graph is captured with: views of the first `bucket` rows."""
        max_k = self.table.shape[1] * block_size
        table, used = self.table[:bucket], self.used[:bucket]
        group = Group(table, max_k, mask if mask is not None else torch.ones(0, dtype=torch.bool), 0, bucket, True)
        plan = StepPlan(self.slots[:bucket], [group], 0)
        setattr(plan, "varlen", VarlenMeta(self.cu_q[: bucket + 1], used, self.cu_k[: bucket + 1],  # noqa: B010
                                           table, 1, max_k))
        return plan


class DecodeGraphs:
    """One captured decode forward per bucket over `cache`; `run` replays the step's bucket or returns None."""

    def __init__(self, lm: LanguageHalf, cache: PagedCache, max_num_seqs: int, max_model_len: int, forward: Forward,
                 enforce_eager: bool = False):
        self.lm, self.cache, self.forward = lm, cache, forward
        self.sizes = buckets(max_num_seqs)
        dev, dtype = cache.device, cache.shape.dtype
        self.enabled = (dev.type == "cuda" and not enforce_eager and dtype in HALF
                        and paged_supported(cache.block_size, str(dev)))
        hidden = lm.config.get_text_config().hidden_size
        probe = lm.adapter.decode_position_ids(0, 0)  # (1, 1), or (3, 1, 1) for M-RoPE
        self.static = StaticInputs.empty(self.sizes[-1], hidden, tuple(probe.shape[:-1]),
                                         -(-max_model_len // cache.block_size), lm.dtype, dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def run(self, plan: StepPlan, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The logits (rows, vocab) of a decode-only step from its bucket's graph; None: run it eagerly."""
        if len(plan.groups) != 1 or not plan.groups[0].decode:
            return None
        group = plan.groups[0]
        bucket = bucket_for(group.table.shape[0], self.sizes)
        if bucket is None or bucket not in self.graphs:
            return None
        self.static.fill(bucket, embeds, positions, plan.slots, group.table, row_lengths(group))
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.num_replays += 1
        return logits[: group.table.shape[0]].clone()

    def step(self, bucket: int) -> torch.Tensor:
        """The forward a bucket's graph holds (eager on its own: what the CPU test runs)."""
        s = self.static
        torch.cumsum(s.used[:bucket], 0, dtype=torch.int32, out=s.cu_k[1 : bucket + 1])
        mask = None
        if self.cache.device.type != "cuda":  # the CPU path reads masks; varlen reads `used`
            kv = torch.arange(s.table.shape[1] * self.cache.block_size, device=s.used.device)
            mask = (kv.view(1, -1) < s.used[:bucket].view(-1, 1)).view(bucket, 1, 1, -1)
        plan = s.plan(bucket, self.cache.block_size, mask)
        logits = self.forward(s.embeds[:, :bucket], s.positions[..., :bucket], plan)
        self.cache.pool.select(self.cache.block_dim, 0).zero_()  # padding rows wrote into the null block (capturable)
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool; on any failure, log it and stay eager."""
        if not self.enabled or self.graphs:
            return
        try:
            pool = None
            for bucket in reversed(self.sizes):
                self.static.fill(bucket, *self._empty_step())
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.step(bucket)  # warm-up: lazy init, cuBLAS workspaces, the paging probe
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.step(bucket)
                pool = graph.pool()
                self.graphs[bucket] = (graph, logits)
        except Exception as exc:  # a model that syncs inside its forward cannot be captured: eager it is
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
            self.graphs.clear()
            self.enabled = False
            return
        logger.info("captured %d CUDA graphs for decode batches of %s rows", len(self.graphs), self.sizes)

    def _empty_step(self) -> tuple[torch.Tensor, ...]:
        """A step of no rows: every row of the bucket is padding."""
        s = self.static
        return (s.embeds[:, :0], s.positions[..., :0], s.slots[:0], s.table[:0], s.used[:0])


def packed_forward(lm: LanguageHalf, cache: PagedCache, mask_like: Callable[[torch.Tensor], Any]) -> Forward:
    """The decode forward a graph captures: the language model over the packed rows, then lm_head on every row
    (LanguageHalf.forward_rows builds its row index from a host list, which a capture cannot hold)."""
    def forward(embeds: torch.Tensor, positions: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        cache.activate(plan)
        try:
            out = lm.module.language_model(inputs_embeds=embeds, position_ids=positions, cache=cache,
                                           attention_mask=mask_like(embeds), use_cache=True)
        finally:
            cache.activate(None)
        return lm.module.lm_head(out.last_hidden_state[0]).float()
    return forward
