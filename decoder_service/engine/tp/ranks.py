"""Rank 0's side of tensor parallelism: start ranks 1..N-1, join their process group, and send each operation that
touches the model or the K/V pool to all of them, in order (vLLM's executor shape: one scheduler, ranks in lockstep).

Start-up: `Ranks.spawn` starts the ranks (each loads its share of the weights while rank 0 loads its own) with one end
of a socket pair each; `connect` waits for each rank's Ready (or its one-line Failed: the decoder does not start), says
Join, and all join the process group on a TCPStore rank 0 opened on a free loopback port (gloo on the CPU, NCCL on
CUDA). Every collective has a timeout (`--tensor-parallel-timeout`, COLLECTIVE_TIMEOUT_S by default).
Steps: `forward` sends the step's plan and inputs, then rank 0 runs its own
share; the layers' all-reduces (epd_models/tensor_parallel.py) keep the ranks in step. Pool operations (`zero`,
`copy_block`, hand-off `scatter_heads` / `gather_heads`) are mirrored so every rank's pool holds the same blocks.
A lock keeps each operation's message and collectives together (the hand-off export runs off the engine thread).

Faults: a rank that exits (its socket's end of file, seen by a watch thread) or a collective that fails or times out
is fatal to the whole decoder: `on_fatal` (default: log one line, kill the ranks, exit 70, the watchdog's status), so
the launcher restarts all N together and the proxy fails requests over as for any dead decoder. A rank sees rank 0's
death as its socket's end of file (and PR_SET_PDEATHSIG), and exits.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decoder_service.engine.step_plan import StepPlan
from decoder_service.engine.tp import wire

logger = logging.getLogger("epd.decoder")
COLLECTIVE_TIMEOUT_S = 60.0  # default: no rank waits longer in one collective (a hung rank ends the decoder)
START_TIMEOUT_S = 1800.0  # a rank's load (a large checkpoint from a slow disk)
FATAL_STATUS = 70


class RankStartError(RuntimeError):
    """A rank could not start (its one line says why)."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: the device `rank` places after rank 0's; CPU: the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _fatal_exit(reason: str) -> None:
    logger.critical("tensor parallelism: %s; the decoder stops (its ranks with it)", reason)
    os._exit(FATAL_STATUS)


class Ranks:
    """Ranks 1..N-1 of one decoder, from rank 0."""

    def __init__(self, size: int, device: torch.device, procs: list[subprocess.Popen[bytes]],
                 socks: list[socket.socket], store: dist.TCPStore, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 on_fatal: Callable[[str], None] = _fatal_exit):
        self.size, self.device, self.procs, self.socks, self.store = size, device, procs, socks, store
        self.timeout_s = timeout_s
        self.on_fatal = on_fatal
        self._lock = threading.Lock()
        self._closing = False
        self.steps = 0  # forwards sent (the benchmark's communication time per step)
        self.broadcast_s = 0.0  # seconds rank 0 spent broadcasting steps

    @classmethod
    def spawn(cls, model_dir: str, size: int, *, dtype: str, device: torch.device, quantized: str,
              threads: int = 0, timeout_s: float = COLLECTIVE_TIMEOUT_S,
              on_fatal: Callable[[str], None] = _fatal_exit) -> Ranks:
        """Start ranks 1..size-1 loading their shares (rank 0 loads its own meanwhile, then calls `connect`)."""
        store = dist.TCPStore("127.0.0.1", 0, world_size=size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        procs, socks = [], []
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            cmd = [sys.executable, "-m", "decoder_service.engine.tp.worker", "--fd", str(theirs.fileno()),
                   "--rank", str(rank), "--size", str(size), "--store-port", str(store.port), "--model", model_dir,
                   "--dtype", dtype, "--device", str(rank_device(device, rank)), "--quantized", quantized,
                   "--threads", str(threads), "--timeout", str(timeout_s)]
            procs.append(subprocess.Popen(cmd, pass_fds=[theirs.fileno()]))
            theirs.close()
            socks.append(ours)
        return cls(size, device, procs, socks, store, timeout_s, on_fatal)

    def connect(self) -> None:
        """Wait until every rank loaded its share, then join the process group (RankStartError: one line why)."""
        try:
            for rank, sock in enumerate(self.socks, start=1):
                msg = wire.recv(sock)
                if isinstance(msg, wire.Failed):
                    raise RankStartError(f"tensor-parallel rank {rank} could not start: {msg.reason}")
                if not isinstance(msg, wire.Ready):
                    code = self.procs[rank - 1].wait()
                    raise RankStartError(f"tensor-parallel rank {rank} exited while starting (status {code})")
            for sock in self.socks:
                wire.send(sock, wire.Join())
            dist.init_process_group(backend_for(self.device), store=self.store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=self.timeout_s))
        except BaseException:
            self.kill()
            raise
        for rank, sock in enumerate(self.socks, start=1):
            threading.Thread(target=self._watch, args=(rank, sock), name=f"epd-tp-watch-{rank}", daemon=True).start()

    # -- the operations every rank mirrors --------------------------------------------------------------------
    def open_pool(self, num_blocks: int, block_size: int) -> Ranks:
        self._send(wire.OpenPool(num_blocks, block_size))
        return self

    def zero(self, blocks: list[int]) -> None:
        self._send(wire.Zero(blocks))

    def copy_block(self, src: int, dst: int) -> None:
        self._send(wire.CopyBlock(src, dst))

    def forward(self, plan: StepPlan, embeds: torch.Tensor, positions: torch.Tensor, extra: dict[str, Any]) -> None:
        """Send the step (the ranks then run it with rank 0, whose forward follows)."""
        msg, pack = wire.forward_message(plan, embeds, positions, extra)
        start = time.perf_counter()
        self._run(msg, lambda: dist.broadcast(pack.buffer(self.device), src=0))
        self.broadcast_s += time.perf_counter() - start
        self.steps += 1

    def scatter_heads(self, blocks: list[int], data: torch.Tensor, first_position: int, num_tokens: int) -> torch.Tensor:
        """Received blocks (n, layers, 2, kv_heads, block, head_dim): each rank gets and writes its heads; rank 0's
        share is returned."""
        parts = [p.contiguous().to(self.device) for p in data.chunk(self.size, dim=3)]
        msg = wire.Scatter(blocks, first_position, num_tokens, list(parts[0].shape),
                           str(parts[0].dtype).removeprefix("torch."))
        out = torch.empty_like(parts[0])
        self._run(msg, lambda: dist.scatter(out, parts, src=0))
        return out.cpu()

    def gather_heads(self, blocks: list[int], local: torch.Tensor) -> torch.Tensor:
        """Blocks out of every rank's pool, their heads put back together: what one rank of all heads would hold."""
        mine = local.to(self.device)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._run(wire.Gather(blocks), lambda: dist.gather(mine, parts, dst=0))
        return torch.cat([p.cpu() for p in parts], dim=3)

    def fail(self, reason: str) -> None:
        """A forward raised on rank 0 after the ranks started it: they cannot be brought back in step."""
        self._fatal(reason)

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _send(self, msg: wire.Message) -> None:
        self._run(msg, None)

    def _run(self, msg: wire.Message, collective: Callable[[], Any] | None) -> None:
        with self._lock:
            try:
                for sock in self.socks:
                    wire.send(sock, msg)
                if collective is not None:
                    collective()
            except Exception as exc:  # noqa: BLE001 - any of them leaves the ranks out of step
                self._fatal(f"{type(msg).__name__} failed: {type(exc).__name__}: {exc}")
                raise

    def _watch(self, rank: int, sock: socket.socket) -> None:
        try:
            sock.recv(1)  # a rank sends nothing after Ready: this returns at its end of file
        except OSError:
            pass
        if not self._closing:
            code = self.procs[rank - 1].poll()
            self._fatal(f"rank {rank} (pid {self.procs[rank - 1].pid}) exited"
                        + (f" with status {code}" if code is not None else ""))

    def _fatal(self, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        self.kill()
        self.on_fatal(reason)

    def kill(self) -> None:
        """SIGKILL every rank, reap them, close their sockets."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for sock in self.socks:
            sock.close()

    def close(self) -> None:
        """Stop the ranks (they leave the loop and exit), then leave the process group."""
        if self._closing:
            return
        self._closing = True
        for sock in self.socks:
            try:
                wire.send(sock, wire.Stop())
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sock in self.socks:
            sock.close()
        if dist.is_initialized():
            dist.destroy_process_group()
