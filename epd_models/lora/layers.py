"""Linears that add each row's adapter in one packed forward: rows of different adapters (and of the base model)
decode in the same step.

`LoRASet` holds the adapters (slot 0 is the base model; adapter i is slot i + 1) and, for the forward under way,
which packed positions belong to each slot (`bind`, from the model runner: one (slot, positions) per segment, in
packing order). Each `LoRALinear` runs its base linear on every position, then, per slot present in the step whose
adapter targets it, `x[rows] @ A.T @ (B x scale).T` added at those rows: a slice where a slot's positions are one
run, a gather and index_add where they are not."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from epd_models.lora.peft_format import LoRAWeights

Selection = slice | torch.Tensor


class LoRASet:
    """The adapters one language model serves, and the slots of the forward under way."""

    def __init__(self, module: nn.Module, adapters: list[LoRAWeights]):
        self.adapters = adapters
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}
        self.current: dict[int, Selection] = {}
        self.device = next(module.parameters()).device
        for slot, adapter in enumerate(adapters, start=1):
            for name, (a, b) in adapter.weights.items():
                layer = module.get_submodule(name)
                if not isinstance(layer, LoRALinear):
                    parent, _, child = name.rpartition(".")
                    layer = LoRALinear(layer, self)
                    setattr(module.get_submodule(parent), child, layer)
                layer.adapters[slot] = (a.to(self.device), b.to(self.device))

    def describe(self) -> list[dict[str, object]]:
        """What /health lists (the proxy routes a request for an adapter to a decoder that lists it)."""
        return [{"name": a.name, "base_model_name": a.base_model_name, "rank": a.rank, "modules": len(a.weights)}
                for a in self.adapters]

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

    def clear(self) -> None:
        self.current = {}


class LoRALinear(nn.Module):
    """A base linear (plain, prepacked or quantized) plus the adapters that target it, by slot."""

    def __init__(self, base: nn.Module, lora: LoRASet):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lora = [lora]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self._lora[0].current.items():
            ab = self.adapters.get(slot)
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice):
                y[..., rows, :] += (x[..., rows, :] @ a.T) @ b.T
            else:
                y.index_add_(-2, rows, (x.index_select(-2, rows) @ a.T) @ b.T)
        return y
