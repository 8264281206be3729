"""E -> P -> D on a decoder worker: a prefill worker hands a request off after its first tokens, a decode worker
continues it.

Prefill side (`--role prefill`, a request with `handoff_key`): the engine prefills the prompt and samples each
choice's first token as usual (streaming it), then `HandoffOut.hand_off` copies the prompt's K/V blocks out of the
pool (decoder_service/engine/kv_blocks.py), keeps them under the key for a decode worker to fetch (bounded in bytes
and time, freed once the decode worker has them: connector/tensors/kv_store.py), and ends the stream with a
`handoff` event: where the blocks are, and each choice's first token and sampler state. The rows give their blocks
back (to the prefix cache).

Decode side (`--role decode`, a request with `handoff`): `resume_from` fetches and checks the blocks off the engine
thread (while the request is prepared); the engine replays each choice's first token without sending it again and
decodes on over the received blocks. Whatever keeps the blocks away (no source, the prefill worker gone, a
timeout, a block that fails its check, another prompt length) leaves `Resume.kv` None: the decode worker then
prefills the prompt itself, and the request goes on exactly as it would have (counted, never failed).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from connector.control.security import CurveConfig
from decoder_service.engine.kv_blocks import KVRefused, check_blocks, export_blocks, kv_layout
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.sequence import Job, Sequence
from decoder_service.engine.work import Resume
from epd_common.tracing import span
from epd_contracts.generate import Event, Handoff, HandoffChoice
from epd_contracts.kv import KVChoice, KVLayout

logger = logging.getLogger("epd.decoder")


class HandoffDeclined(Exception):
    """A prefill worker declines a hand-off (its prompt is short: --handoff-min-tokens): the proxy runs the request
    on a decode worker, which prefills it itself. Not an error: the stream's one event is `declined`."""


class KVFetch(Protocol):
    """connector/tensors/kv_client.py KVClient.fetch: raises (KVUnavailable) when the blocks cannot be had."""

    def __call__(self, address: str, key: str, layout: KVLayout, first_block: int = 0,
                 timeout: float = 10.0) -> Any: ...


def resume_from(handoff: Handoff, num_tokens: int, fetch: KVFetch | None, layout: KVLayout, shape: KVShape,
                timeout: float, held: int = 0) -> Resume:
    """The blocks of `handoff` from block `held` on (those before it are this worker's prefix cache's), fetched and
    checked against this worker's model and this prompt of `num_tokens`; a Resume without them (and why) when
    anything is off."""
    if fetch is None or not handoff.source:
        return Resume(handoff, None, "no K/V source")
    if handoff.num_tokens != num_tokens:
        return Resume(handoff, None, f"the hand-off covers {handoff.num_tokens} positions, the prompt here has "
                                     f"{num_tokens}")
    try:
        got = _fetched(fetch, handoff, layout, held, timeout)
        want_blocks = -(-num_tokens // layout.block_size)
        if got.num_tokens != num_tokens or got.num_blocks != want_blocks or got.first_block != held \
                or got.blocks.shape[0] != want_blocks - held:
            raise KVRefused(f"{got.blocks.shape[0]} of {got.num_blocks} blocks of {got.num_tokens} positions from "
                            f"block {got.first_block}; the prompt needs {want_blocks} blocks of {num_tokens} from "
                            f"block {held}")
        if [c.first_token for c in got.choices] != [c.first_token for c in handoff.choices if c.first_token is not None]:
            raise KVRefused("the blocks' first tokens are not the hand-off's")
        check_blocks(got.blocks, layout, shape, layout.block_size, num_tokens, values=False)  # values: the client's
    except Exception as exc:  # noqa: BLE001 - whatever keeps the blocks away, the prompt is prefilled here
        logger.warning("hand-off %s: K/V from %s not used (%s: %s); prefilling here", handoff.key, handoff.source,
                       type(exc).__name__, exc)
        return Resume(handoff, None, f"{type(exc).__name__}: {exc}")
    return Resume(handoff, got.blocks, first_block=held)


def _fetched(fetch: KVFetch, handoff: Handoff, layout: KVLayout, held: int, timeout: float) -> Any:
    """The fetch, traced as `kv.get` (the prefill worker's `kv.serve` is its child): bytes and transport."""
    with span("kv.get", {"epd.first_block": held}, "client") as traced:
        got = fetch(handoff.source, handoff.key, layout, held, timeout)
        if traced is not None:
            traced.set_attributes({"epd.bytes": int(got.blocks.nbytes), "epd.blocks": int(got.blocks.shape[0]),
                                   "epd.transport": "shm" if getattr(got, "shm", False) else "socket"})
        return got


class KVKeep(Protocol):
    """connector/tensors/kv_store.py KVStore.put."""

    def put(self, key: str, layout: KVLayout, num_tokens: int, blocks: torch.Tensor,
            choices: list[KVChoice]) -> bool: ...


@dataclass
class HandoffOut:
    """A prefill worker's side: where its blocks are kept and fetched from."""

    store: KVKeep
    source: Callable[[], str]  # the K/V endpoint's address (known once its server is bound)
    layout: KVLayout
    _keeper: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "epd-kv-keep"))

    @classmethod
    def of(cls, store: KVKeep, source: Callable[[], str], shape: KVShape, block_size: int,
           fingerprint: str) -> HandoffOut:
        return cls(store, source, kv_layout(shape, block_size, fingerprint))

    def hand_off(self, job: Job, seqs: list[Sequence], pool_blocks: list[int], cache: Any) -> None:
        """Copy the prompt's blocks (`pool_blocks`, the first row's) out of the pool now (the engine frees them next),
        then, on the keeper's thread, keep them under the job's key and send the `handoff` event naming them and each
        continuing choice (`seqs`, each with its first token): placing them in shared memory costs about a copy and
        a check more, which the engine thread does not wait for."""
        key = job.work.handoff_key
        assert key is not None
        num_tokens = job.prompt.num_tokens
        choices = [HandoffChoice() for _ in range(job.params.n)]
        for seq in seqs:
            state = b"" if job.params.greedy else bytes(seq.sampler.generator.get_state().numpy())
            choices[seq.index] = HandoffChoice(first_token=seq.generated[0], generator_state=state,
                                               logprobs=list(seq.entries))  # held back with its text
        data = export_blocks(cache, pool_blocks[: -(-num_tokens // self.layout.block_size)])
        self._keeper.submit(self._keep, job, key, num_tokens, data, choices)

    def _keep(self, job: Job, key: str, num_tokens: int, data: torch.Tensor, choices: list[HandoffChoice]) -> None:
        try:
            kept = self.store.put(key, self.layout, num_tokens, data,
                                  [KVChoice(first_token=c.first_token, generator_state=c.generator_state)
                                   for c in choices if c.first_token is not None])
        except Exception:  # noqa: BLE001 - whatever it was, the decode worker prefills the prompt itself
            logger.exception("hand-off %s: its K/V could not be kept; the decode worker will prefill", key)
            kept = False
        if not kept:
            logger.warning("hand-off %s: %d bytes of K/V not kept (the store's bound); the decode worker will prefill",
                           key, data.nbytes)
        try:
            job.emit(Event(type="handoff", handoff=Handoff(key=key, source=self.source() if kept else "",
                                                           num_tokens=num_tokens, choices=choices,
                                                           cached_tokens=job.cached_tokens)))
        except Exception:  # noqa: BLE001 - its loop is gone: the client left
            logger.warning("hand-off %s: its client is gone", key)

    def close(self) -> None:
        self._keeper.shutdown(wait=True)


def kv_curves(curve: CurveConfig | None) -> tuple[CurveConfig | None, CurveConfig | None]:
    """(the K/V server's, the K/V client's) CURVE keys, from the decoders' own client key pair: a prefill worker
    serves with it and admits only it, a decode worker connects with it and expects it. No new key material, and
    only holders of the decoders' secret key (decoders and proxies) can pull K/V."""
    if curve is None:
        return None, None
    server = CurveConfig(curve.secret_key, curve.public_key, allowed_clients=frozenset({curve.public_key}))
    return server, CurveConfig(curve.secret_key, curve.public_key, server_key=curve.public_key)


@dataclass
class HandoffEndpoints:
    """A decoder's K/V endpoints for its role: the store and server a prefill worker keeps blocks in and serves them
    from, the client a decode worker fetches with."""

    out: HandoffOut | None = None
    server: Any = None  # connector/tensors/kv_server.py KVServer
    client: Any = None  # connector/tensors/kv_client.py KVClient
    store: Any = None  # connector/tensors/kv_store.py KVStore (its shared-memory segments' fds)

    @classmethod
    def start(cls, role: str, layout: KVLayout, curve: CurveConfig | None, bind: str, advertise_host: str | None,
              store_bytes: int, ttl_s: float, shm: bool = True) -> HandoffEndpoints:
        """`shm`: a decode worker maps same-host prefill workers' shared memory (after a probe), else socket only."""
        from connector.tensors.kv_client import KVClient
        from connector.tensors.kv_server import KVServer
        from connector.tensors.kv_store import KVStore

        server_curve, client_curve = kv_curves(curve)
        out = cls(client=KVClient(curve=client_curve, shm=shm) if role in ("decode", "both") else None)
        if role == "prefill":
            store = out.store = KVStore(store_bytes, ttl_s)
            out.server = KVServer(store, bind=bind, curve=server_curve, advertise_host=advertise_host).start()
            out.out = HandoffOut(store, lambda: str(out.server.address), layout)
        return out

    @property
    def fetch(self) -> KVFetch | None:
        """The decode worker's fetch: it tells the prefill worker once it has the blocks, which frees them then."""
        client = self.client
        if client is None:
            return None

        def fetch(address: str, key: str, layout: KVLayout, first_block: int = 0, timeout: float = 10.0) -> Any:
            return client.fetch(address, key, layout, first_block, timeout, release=True)
        return fetch

    def stats(self) -> dict[str, Any]:
        """A prefill worker's hand-off store (what it holds, and how entries left it) and its K/V server's counters;
        empty for other roles."""
        if self.store is None or self.server is None:
            return {}
        return {**self.store.stats(), **self.server.stats()}

    @property
    def address(self) -> str | None:
        return None if self.server is None else str(self.server.address)

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
        for part in (self.server, self.client, self.store):
            if part is not None:
                part.close()
