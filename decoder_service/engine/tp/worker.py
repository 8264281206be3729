"""A tensor-parallel rank other than 0: load this rank's share of the language model, then run what rank 0 sends, in
order, until rank 0 says Stop or goes away (its socket's end of file). Started by rank 0 (ranks.py), never by hand.

Its forward is rank 0's without the lm_head: the same module call on the plan and inputs rank 0 broadcast, through the
same paged attention over this rank's share of the pool (its K/V heads), the layers' all-reduces in step with the
other ranks. Anything that fails here ends this process (non-zero): rank 0 sees it and stops the whole decoder.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from decoder_service.engine.kv_blocks import export_blocks, import_blocks
from decoder_service.engine.kv_cache import PagedCache
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.paged_attention import ATTENTION
from decoder_service.engine.step_inputs import StepInputs
from decoder_service.engine.tp import wire
from decoder_service.engine.tp.ranks import backend_for
from epd_models.halves import LanguageHalf

logger = logging.getLogger("epd.decoder")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when rank 0 dies (its socket's end of file covers the rest)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epd-decoder tensor-parallel rank", allow_abbrev=False)
    for flag in ("--fd", "--rank", "--size", "--store-port", "--threads"):
        p.add_argument(flag, type=int, required=True)
    for flag in ("--model", "--dtype", "--device", "--quantized"):
        p.add_argument(flag, required=True)
    p.add_argument("--timeout", type=float, required=True)
    return p.parse_args(argv)


class Rank:
    def __init__(self, lm: LanguageHalf):
        self.lm = lm
        lm.module.language_model.config._attn_implementation = ATTENTION
        self.shape = KVShape.of(lm.config.get_text_config(), next(lm.module.parameters()).dtype, lm.tp_size)
        self.cache: PagedCache | None = None
        self.inputs: StepInputs | None = None

    def handle(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.OpenPool):
            self.cache = PagedCache(self.shape, msg.num_blocks, msg.block_size, self.lm.device)
            self.inputs = StepInputs(self.lm, msg.block_size)
            return
        cache = self.cache
        assert cache is not None, f"{type(msg).__name__} before the pool opened"
        if isinstance(msg, wire.Zero):
            cache.zero(msg.blocks)
        elif isinstance(msg, wire.CopyBlock):
            cache.copy_block(msg.src, msg.dst)
        elif isinstance(msg, wire.Forward):
            self.forward(cache, msg)
        elif isinstance(msg, wire.Scatter):
            out = torch.empty(msg.shape, dtype=getattr(torch, msg.dtype), device=self.lm.device)
            dist.scatter(out, None, src=0)
            import_blocks(cache, msg.blocks, out, msg.first_position, msg.num_tokens)
        elif isinstance(msg, wire.Gather):
            dist.gather(export_blocks(cache, msg.blocks).to(self.lm.device), None, dst=0)
        else:
            raise ValueError(f"unexpected {type(msg).__name__}")

    @torch.inference_mode()
    def forward(self, cache: PagedCache, msg: wire.Forward) -> None:
        buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=self.lm.device)
        dist.broadcast(buf, src=0)
        plan, embeds, positions, extra = wire.forward_inputs(msg, buf)
        assert self.inputs is not None
        cache.activate(plan)
        try:
            self.lm.module.language_model(inputs_embeds=embeds, position_ids=positions, cache=cache,
                                          attention_mask=self.inputs.dummy_mask(embeds), use_cache=True, **extra)
        finally:
            cache.activate(None)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sock = socket.socket(fileno=args.fd)
    try:
        lm = LanguageHalf(args.model, None if args.dtype == "auto" else args.dtype, args.device, args.quantized,
                          tp_rank=args.rank, tp_size=args.size)
    except Exception as exc:  # noqa: BLE001 - the one line rank 0 prints before the decoder exits
        wire.send(sock, wire.Failed(args.rank, f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    rank = Rank(lm)
    wire.send(sock, wire.Ready(args.rank))
    if not isinstance(wire.recv(sock), wire.Join):  # rank 0 failed to start, or another rank did
        sys.exit(1)
    store = dist.TCPStore("127.0.0.1", args.store_port, world_size=args.size, is_master=False,
                          timeout=timedelta(seconds=args.timeout))
    dist.init_process_group(backend_for(lm.device), store=store, rank=args.rank, world_size=args.size,
                            timeout=timedelta(seconds=args.timeout))
    while True:
        msg = wire.recv(sock)
        if msg is None or isinstance(msg, wire.Stop):
            break
        rank.handle(msg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
