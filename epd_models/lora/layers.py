"""Linears that add each row's adapter in one packed forward: rows of different adapters (and of the base model)
decode in the same step.

`LoRASet` holds the adapters (slot 0 is the base model; each adapter loaded gets a slot of its own, never reused)
and, for the forward under way, which packed positions belong to each slot (`bind`, from the model runner: one
(slot, positions) per segment, in packing order). Each `LoRALinear` runs its base linear on every position, then, per
slot present in the step whose adapter targets it, `x[rows] @ A.T @ (B x scale).T` added at those rows: a slice
where a slot's positions are one run, a gather and index_add where they are not.

Adapters come and go at runtime (`add`, `remove`): a request holds its adapter's slot from preparation to the end of
its stream (`acquire` / `release`), so an adapter removed while requests use it stops taking new ones at once and its
weights go when the last of them ends: running streams are unchanged."""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from epd_models.lora.peft_format import LoRAError, LoRAWeights

Selection = slice | torch.Tensor


class LoRASet:
    """The adapters one language model serves, and the slots of the forward under way."""

    def __init__(self, module: nn.Module, adapters: list[LoRAWeights], max_loras: int | None = None):
        self.module = module
        self.max_loras = max_loras if max_loras is not None else len(adapters)
        self.loaded: dict[int, LoRAWeights] = {}  # slot -> adapter, until its weights are freed
        self.slots: dict[str, int] = {}  # name -> slot of the adapters that take new requests
        self.users: Counter[int] = Counter()  # slot -> requests holding it
        self.retired: set[int] = set()  # removed, freed when its last user releases it
        self.current: dict[int, Selection] = {}
        self.device = next(module.parameters()).device
        self._next, self._lock = 1, threading.Lock()
        for adapter in adapters:
            self.add(adapter)

    def add(self, adapter: LoRAWeights) -> int:
        """Serve `adapter` under its name (LoRAError: the name is taken, or --max-loras adapters are loaded)."""
        with self._lock:
            if adapter.name in self.slots:
                raise LoRAError(f"adapter {adapter.name!r} is already loaded")
            if len(self.loaded) >= self.max_loras:
                raise LoRAError(f"{len(self.loaded)} adapters are loaded, the most --max-loras {self.max_loras} "
                                "allows (unload one first)")
            slot, self._next = self._next, self._next + 1
            for name, (a, b) in adapter.weights.items():
                layer = self.module.get_submodule(name)
                if not isinstance(layer, LoRALinear):
                    parent, _, child = name.rpartition(".")
                    layer = LoRALinear(layer, self)
                    setattr(self.module.get_submodule(parent), child, layer)
                elif layer.lora is not self:  # a model given adapters again (a new engine on it): this set's only
                    layer.attach(self)
                layer.adapters[slot] = (a.to(self.device), b.to(self.device))
            self.loaded[slot] = adapter
            self.slots[adapter.name] = slot
            return slot

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not): no new request takes it; its weights go once unused."""
        with self._lock:
            slot = self.slots.pop(name)
            self.retired.add(slot)
            if not self.users[slot]:
                self._free(slot)

    def acquire(self, name: str) -> int:
        """The slot of adapter `name` ("" the base model: 0), held until `release` (KeyError: not served)."""
        if not name:
            return 0
        with self._lock:
            slot = self.slots[name]
            self.users[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        if not slot:
            return
        with self._lock:
            self.users[slot] -= 1
            if not self.users[slot]:
                del self.users[slot]
                if slot in self.retired:
                    self._free(slot)

    def _free(self, slot: int) -> None:
        self.retired.discard(slot)
        del self.loaded[slot]
        for layer in self.module.modules():
            if isinstance(layer, LoRALinear):
                layer.adapters.pop(slot, None)

    def describe(self) -> list[dict[str, object]]:
        """What /health lists (the proxy routes a request for an adapter to a decoder that lists it)."""
        with self._lock:
            return [{"name": a.name, "base_model_name": a.base_model_name, "rank": a.rank, "modules": len(a.weights)}
                    for slot, a in sorted(self.loaded.items()) if self.slots.get(a.name) == slot]

    def slot(self, name: str) -> int:
        """The slot of adapter `name` ("" is the base model: 0); KeyError for one not loaded."""
        return self.slots[name] if name else 0

    def bind(self, runs: Iterable[tuple[int, int]]) -> None:
        """The next forward's packed positions: (slot, positions) per segment, in packing order."""
        picks: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, num in runs:
            if slot:
                spans = picks.setdefault(slot, [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + num)
                else:
                    spans.append((start, start + num))
            start += num
        self.current = {slot: slice(*spans[0]) if len(spans) == 1 else
                        torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device, non_blocking=True)
                        for slot, spans in picks.items()}


class LoRALinear(nn.Module):
    """A base linear (plain, prepacked or quantized) plus the adapters that target it, by slot."""

    def __init__(self, base: nn.Module, lora: LoRASet):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lora = [lora]  # a list: not a submodule

    @property
    def lora(self) -> LoRASet:
        return self._lora[0]

    def attach(self, lora: LoRASet) -> None:
        """Serve `lora`'s adapters instead of those it had."""
        self._lora, self.adapters = [lora], {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.lora.current.items():
            ab = self.adapters.get(slot)
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice):
                y[..., rows, :] += (x[..., rows, :] @ a.T) @ b.T
            else:
                y.index_add_(-2, rows, (x.index_select(-2, rows) @ a.T) @ b.T)
        return y
