"""The K/V hand-off's transfer rate outside the stacks (epd_bench/prefill_decode.py): KVClient.fetch of a prompt's
blocks from a KVServer + KVStore in a child process against a raw ZeroMQ reply of the same bytes
(epd_bench/connector.py's), alternating, no CURVE (as the benchmark's stacks)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from transformers import AutoConfig

from connector.tensors.frames import DTYPES
from connector.tensors.kv_client import KVClient
from connector.tensors.kv_server import KVServer
from connector.tensors.kv_store import KVStore
from decoder_service.engine.kv_blocks import kv_layout
from decoder_service.engine.kv_shape import KVShape
from epd_bench.connector import child
from epd_bench.micro import check, interleaved, summary
from epd_bench.stacks import HOST
from epd_contracts.kv import KVChoice, KVLayout

KV_KEY = "bench-handoff"


def layout_of(model_dir: Path, health: dict[str, Any]) -> KVLayout:
    """The decode worker's K/V layout: its model's shape in the dtype whose bytes per token its /health reports."""
    text, kv = AutoConfig.from_pretrained(model_dir).get_text_config(), health["kv_cache"]
    shape = next(s for s in (KVShape.of(text, d) for d in (torch.float32, torch.bfloat16))
                 if s.bytes_per_token == kv["bytes_per_token"])
    return kv_layout(shape, kv["block_size"], str(health["model_identity"]["fingerprint"]))


def serve_kv(layout_json: bytes, num_tokens: int, conn: Connection) -> None:
    """Child: a KVServer over a KVStore holding one hand-off of `num_tokens`; its address on `conn`, until it closes."""
    layout = msgspec.json.decode(layout_json, type=KVLayout)
    blocks = torch.randn(-(-num_tokens // layout.block_size), *layout.block_shape).to(DTYPES[layout.dtype])
    store = KVStore(max_bytes=blocks.nbytes + (1 << 20), ttl_s=24 * 3600.0)
    store.put(KV_KEY, layout, num_tokens, blocks, [KVChoice(first_token=1)])
    server = KVServer(store).start()
    conn.send(server.address)
    with contextlib.suppress(EOFError):  # the parent closed its end: stop
        conn.recv()
    server.close()


def transfer(layout: KVLayout, num_tokens: int) -> dict[str, Any]:
    """KVClient.fetch of `num_tokens` positions of K/V from a KVServer child vs raw ZeroMQ of the same bytes."""
    num_blocks = -(-num_tokens // layout.block_size)
    nbytes = num_blocks * int(np.prod(layout.block_shape)) * DTYPES[layout.dtype].itemsize
    iters = max(30, min(300, (1 << 30) // nbytes))
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=serve_kv, args=(msgspec.json.encode(layout), num_tokens, theirs), daemon=True)
    server.start()
    theirs.close()
    client = KVClient()
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    closing: list[Any] = [client, dealer, ours]  # ours: the child's recv ends
    try:
        check(ours.poll(120), "the KV server child did not start")
        address = ours.recv()
        with child(["--serve", "raw", "--bind", f"tcp://{HOST}:0", "--sizes", str(nbytes)]) as (_, raw_address):
            dealer.connect(raw_address)

            def fetch() -> None:
                check(client.fetch(address, KV_KEY, layout, timeout=60).blocks.nbytes == nbytes, "kv_fetch: size")

            def raw() -> None:
                dealer.send_multipart([str(nbytes).encode()])
                check(len(dealer.recv_multipart(copy=False)[-1]) == nbytes, "raw_zmq: size")

            times = interleaved({"kv_fetch": fetch, "raw_zmq": raw}, iters, warmup=max(3, iters // 20))
    finally:
        for each in closing:
            each.close()
        server.join(timeout=10)
    stats = {k: summary(v, nbytes) for k, v in times.items()}
    return {"num_tokens": num_tokens, "blocks": num_blocks, "bytes": nbytes, "layout": msgspec.to_builtins(layout),
            **stats, **{f"{k}_mb_s": round(s["throughput_gbps"] * 1000.0, 1) for k, s in stats.items()},
            "ratio": round(float(np.median(times["raw_zmq"]) / np.median(times["kv_fetch"])), 3)}
