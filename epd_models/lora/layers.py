"""Linears that add each row's adapter in one packed forward: rows of different adapters (and of the base model)
decode in the same step.

`LoRASet` holds the adapters (slot 0 is the base model; each adapter loaded gets a slot of its own, never reused).
Every `LoRALinear` keeps all loaded adapters' A and B (B times the adapter's scale) side by side along the rank:
`a_cat` (width, in) and `b_cat` (out, width), adapter `slot` in columns `layout[slot]` (zeros where it does not
target that linear). Before each forward the model runner says which packed positions belong to which slot (`bind`:
one (slot, positions) per segment, in packing order), and each LoRA'd linear adds, after its base linear:
  - where the adapters' positions are long runs (prompt chunks; a step of one adapter): per run,
    `x[run] @ A.T @ B.T` on views of its adapter's columns;
  - otherwise (decode rows of many adapters interleaved): all at once, `((x @ a_cat.T) * mask) @ b_cat.T`, the mask
    keeping each position's own adapter's columns: two matmuls per linear however many adapters share the step
    (the gathered form; a loop over adapters costs a gather, two matmuls and a scatter per adapter and linear:
    bench-peer, 8 adapters of rank 16 at 16 in flight, 0.47x the base model's tokens/s against 0.69-0.70x).

Adapters come and go at runtime (`add`, `remove`): the layers change only on the engine thread, at the next `bind`,
so a forward never sees half a change. A request holds its adapter's slot from preparation to the end of its stream
(`acquire` / `release`): an adapter removed while requests use it takes no new ones at once and its weights go when
the last of them ends, so running streams are unchanged."""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch
from torch import nn

from epd_models.lora.peft_format import LoRAError, LoRAWeights

LONG_RUN = 32  # positions per run (on average) from which runs are looped over rather than masked


class AdaptersBusy(LoRAError):
    """Every resident slot (--max-loras) holds an adapter some request is using: `freed` completes when one of them
    is released (registered under the same lock as the check, so no release is missed)."""

    def __init__(self, name: str, freed: Future[None]):
        super().__init__(f"adapter {name!r} waits for a resident slot: every --max-loras slot is in use")
        self.freed = freed


class LoRASet:
    """The adapters one language model serves, and the selection of the forward under way.

    Adapters known (`known`, at most `max_cpu_loras`: host memory) become resident (`slots`, at most `max_loras`:
    columns in every LoRA'd linear) when a request acquires one; a resident adapter no request holds is evicted,
    least recently used first, to make room (vLLM's --max-loras / --max-cpu-loras). A request for an adapter while
    every resident one is in use gets AdaptersBusy and waits for a release. The modality defaults (`defaults`) stay
    resident."""

    def __init__(self, module: nn.Module, adapters: list[LoRAWeights], max_loras: int | None = None,
                 dtype: torch.dtype | None = None, pack: bool = False, max_cpu_loras: int | None = None):
        self.module = module
        self.pack = pack  # CPU float32: the gathered form's weights prepacked for oneDNN (LoRALinear._pack)
        self.max_loras = max_loras if max_loras is not None else len(adapters)
        self.max_cpu_loras = max(self.max_loras, max_cpu_loras or 0)
        self.known: dict[str, LoRAWeights] = {}  # name -> adapter, in host memory, resident or not
        self.loaded: dict[int, LoRAWeights] = {}  # slot -> resident adapter, until its weights are freed
        self.slots: dict[str, int] = {}  # name -> slot of the resident adapters that take new requests
        self.recent: OrderedDict[str, None] = OrderedDict()  # resident names, least recently acquired first
        self.users: Counter[int] = Counter()  # slot -> requests holding it
        self.retired: set[int] = set()  # removed or evicted, freed when its last user releases it
        self.defaults: dict[str, str] = {}  # modality -> the adapter its requests take unasked (not listed)
        self.evictions = 0
        self.layout: dict[int, tuple[int, int]] = {}  # slot -> its columns in every layer's a_cat / b_cat
        self.runs: list[tuple[int, slice]] = []  # the forward under way: (slot, positions) of long runs ...
        self.mask: torch.Tensor | None = None  # ... or, for short interleaved runs, the column mask
        self.device = next(module.parameters()).device
        self.dtype = dtype or next(module.parameters()).dtype  # the LM's compute dtype: the adapters' and mask's
        self._next, self._lock = 1, threading.Lock()
        self._waiters: list[Future[None]] = []  # requests waiting for a resident slot (AdaptersBusy)
        self._pending: list[Callable[[], None]] = []  # layer changes, applied by the engine thread (bind)
        for adapter in adapters:
            self.add(adapter)
        self._apply()

    def add(self, adapter: LoRAWeights) -> None:
        """Serve `adapter` under its name, resident at once while a slot is free (LoRAError: the name is taken, or
        --max-cpu-loras adapters are known)."""
        with self._lock:
            if adapter.name in self.known:
                raise LoRAError(f"adapter {adapter.name!r} is already loaded")
            if len(self.known) >= self.max_cpu_loras:
                raise LoRAError(f"{len(self.known)} adapters are loaded, the most --max-cpu-loras "
                                f"{self.max_cpu_loras} allows (unload one first)")
            self.known[adapter.name] = adapter
            if len(self.loaded) < self.max_loras:
                self._make_resident(adapter)

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not): no new request takes it; its weights go once unused."""
        with self._lock:
            del self.known[name]
            if name in self.slots:
                self._retire(name)

    def acquire(self, name: str) -> int:
        """The slot of adapter `name` ("" the base model: 0), made resident if it is not (evicting the least
        recently used adapter no request holds), held until `release`. KeyError: not served; AdaptersBusy: every
        resident slot is in use."""
        if not name:
            return 0
        with self._lock:
            if name not in self.slots:
                adapter = self.known[name]
                if len(self.loaded) >= self.max_loras:
                    idle = [n for n in self.recent if not self.users[self.slots[n]] and n not in
                            self.defaults.values()]
                    if not idle or len(self.loaded) - 1 >= self.max_loras:  # retired ones still in use count
                        freed: Future[None] = Future()
                        self._waiters.append(freed)
                        raise AdaptersBusy(name, freed)
                    self._retire(idle[0])
                    self.evictions += 1
                self._make_resident(adapter)
            slot = self.slots[name]
            self.recent.move_to_end(name)
            self.users[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        if not slot:
            return
        with self._lock:
            self.users[slot] -= 1
            if self.users[slot]:
                return
            del self.users[slot]
            if slot in self.retired:
                self._free(slot)
            waiters, self._waiters = self._waiters, []
        for freed in waiters:  # a slot may be evicted now: each waiting request tries again
            freed.set_result(None)

    def _make_resident(self, adapter: LoRAWeights) -> None:
        slot, self._next = self._next, self._next + 1
        self.loaded[slot] = adapter
        self.slots[adapter.name] = slot
        self.recent[adapter.name] = None
        self._pending.append(lambda: self._add_layers(slot, adapter))

    def _retire(self, name: str) -> None:
        slot = self.slots.pop(name)
        self.recent.pop(name, None)
        self.retired.add(slot)
        if not self.users[slot]:
            self._free(slot)

    def _free(self, slot: int) -> None:
        self.retired.discard(slot)
        del self.loaded[slot]
        self._pending.append(lambda: self._drop_layers(slot))

    def describe(self) -> list[dict[str, object]]:
        """What /health lists (the proxy routes a request for an adapter to a decoder that lists it): every adapter
        known, resident or not, but the modality defaults."""
        with self._lock:
            return [{"name": a.name, "base_model_name": a.base_model_name, "rank": a.rank, "modules": len(a.weights),
                     "resident": a.name in self.slots, "vision": a.other_half > 0}
                    for a in self.known.values() if a.name not in self.defaults.values()]

    def slot(self, name: str) -> int:
        """The slot of resident adapter `name` ("" is the base model: 0); KeyError for one not resident."""
        return self.slots[name] if name else 0

    def use(self, slot: int) -> None:
        """The next forwards run every position under adapter `slot` (0: the base model): the encoder's vision
        forward, one adapter per batch (pending changes are applied first)."""
        self._apply()
        self.runs, self.mask = ([(slot, slice(None))] if slot else []), None

    # -- the engine thread ----------------------------------------------------------------------------------
    def bind(self, runs: Iterable[tuple[int, int]]) -> None:
        """The next forward's packed positions: (slot, positions) per segment, in packing order (pending adapter
        changes are applied first)."""
        self._apply()
        spans: list[tuple[int, int, int]] = []  # (slot, start, end), runs of one adapter merged
        total = 0
        for slot, num in runs:
            if slot and slot in self.layout:
                if spans and spans[-1][0] == slot and spans[-1][2] == total:
                    spans[-1] = (slot, spans[-1][1], total + num)
                else:
                    spans.append((slot, total, total + num))
            total += num
        self.runs, self.mask = [], None
        if not spans or sum(b - a for _, a, b in spans) >= LONG_RUN * len(spans):
            self.runs = [(slot, slice(a, b)) for slot, a, b in spans]
            return
        mask = torch.zeros(total, max(c1 for _, c1 in self.layout.values()))
        for slot, a, b in spans:
            c0, c1 = self.layout[slot]
            mask[a:b, c0:c1] = 1
        self.mask = mask.to(self.device, self.dtype, non_blocking=True)

    def _apply(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for change in pending:
            change()

    def _layers(self) -> list[LoRALinear]:
        return [m for m in self.module.modules() if isinstance(m, LoRALinear) and m.lora is self]

    def _add_layers(self, slot: int, adapter: LoRAWeights) -> None:
        for name in adapter.weights:
            layer = self.module.get_submodule(name)
            if not isinstance(layer, LoRALinear):
                parent, _, child = name.rpartition(".")
                setattr(self.module.get_submodule(parent), child, LoRALinear(layer, self, name))
            elif layer.lora is not self:  # a model given adapters again (a new engine on it): this set's only
                layer.attach(self)
        start = max((c1 for _, c1 in self.layout.values()), default=0)
        self.layout[slot] = (start, start + adapter.rank)
        for layer in self._layers():
            layer.grow(slot, adapter.rank, adapter.weights.get(layer.name))

    def _drop_layers(self, slot: int) -> None:
        c0, c1 = self.layout.pop(slot)
        self.layout = {s: (a - (c1 - c0) if a >= c1 else a, b - (c1 - c0) if a >= c1 else b)
                       for s, (a, b) in self.layout.items()}
        for layer in self._layers():
            layer.shrink(slot, c0, c1)


class LoRALinear(nn.Module):
    """A base linear (plain, prepacked or quantized) plus every loaded adapter's A and B side by side."""

    def __init__(self, base: nn.Module, lora: LoRASet, name: str):
        super().__init__()
        self.base, self.name = base, name  # its name in the model: what an adapter's weights are keyed by
        fin, fout = base.in_features, base.out_features
        assert isinstance(fin, int) and isinstance(fout, int), f"{name} is not a linear"
        self.in_features, self.out_features = fin, fout
        self.a_cat: torch.Tensor | None = None  # (width, in)
        self.b_cat: torch.Tensor | None = None  # (out, width), each adapter's B times its scale
        self.targets: set[int] = set()  # slots whose adapter has weights here
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU: a_cat and b_cat prepacked (_pack)
        self._lora = [lora]  # a list: not a submodule

    @property
    def lora(self) -> LoRASet:
        return self._lora[0]

    def attach(self, lora: LoRASet) -> None:
        """Serve `lora`'s adapters instead of those it had."""
        self._lora, self.a_cat, self.b_cat, self.targets = [lora], None, None, set()

    def grow(self, slot: int, rank: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Columns for adapter `slot` at the end: its weights here, or zeros where it does not target this linear."""
        lora = self.lora
        a, b = weights if weights is not None else (torch.zeros(rank, self.in_features, dtype=lora.dtype),
                                                    torch.zeros(self.out_features, rank, dtype=lora.dtype))
        a, b = a.to(lora.device), b.to(lora.device)
        self.a_cat = a if self.a_cat is None else torch.cat([self.a_cat, a])
        self.b_cat = b if self.b_cat is None else torch.cat([self.b_cat, b], dim=1)
        if weights is not None:
            self.targets.add(slot)
        self._pack()

    def shrink(self, slot: int, c0: int, c1: int) -> None:
        assert self.a_cat is not None and self.b_cat is not None
        self.a_cat = torch.cat([self.a_cat[:c0], self.a_cat[c1:]])
        self.b_cat = torch.cat([self.b_cat[:, :c0], self.b_cat[:, c1:]], dim=1)
        self.targets.discard(slot)
        self._pack()

    def _pack(self) -> None:
        """CPU float32: the gathered form's two matmuls through oneDNN's prepacked weights, as the base linears
        (decoder_service/engine/cpu_linear.py: MKL costs a few rows about as much as that many single rows)."""
        a, b = self.a_cat, self.b_cat
        self.packed = None
        if self.lora.pack and a is not None and b is not None and a.device.type == "cpu" \
                and a.dtype == torch.float32 and a.numel():
            self.packed = (torch.ops.mkldnn._reorder_linear_weight(a.contiguous()),
                           torch.ops.mkldnn._reorder_linear_weight(b.contiguous()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        lora, a, b = self.lora, self.a_cat, self.b_cat
        if a is None or b is None or not self.targets:
            return y
        if lora.mask is not None:
            if self.packed is not None:
                linear = torch.ops.mkldnn._linear_pointwise
                y += linear(linear(x, self.packed[0], None, "none", [], "") * lora.mask, self.packed[1], None, "none",
                            [], "")
            else:
                y += ((x @ a.T) * lora.mask) @ b.T
            return y
        for slot, rows in lora.runs:
            if slot in self.targets:
                c0, c1 = lora.layout[slot]
                y[..., rows, :] += (x[..., rows, :] @ a[c0:c1].T) @ b[:, c0:c1].T
        return y
