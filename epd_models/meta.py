"""Build a module with its parameters on the meta device and its buffers real, as accelerate's
`init_empty_weights(include_buffers=False)` does (the helper is not in transformers 5.24).

Why not `torch.device("meta")` and `to_empty`: buffers computed in `__init__` and not saved in checkpoints
(SigLIP's `position_ids`, rotary `inv_freq`) would then be garbage. Loading with `assign=True` then replaces each
meta parameter by its checkpoint tensor; a parameter left on meta is a weight the checkpoint lacks.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_LOCK = threading.Lock()  # the patch is process-wide: one build at a time


@contextmanager
def params_on_meta() -> Iterator[None]:
    real = torch.nn.Module.register_parameter

    def register(self: torch.nn.Module, name: str, param: Any) -> None:
        real(self, name, param)
        if param is not None:
            self._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    with _LOCK:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = real  # type: ignore[method-assign]


def meta_parameters(module: torch.nn.Module) -> list[str]:
    """Names of parameters still on meta (not loaded)."""
    return [name for name, p in module.named_parameters() if p.is_meta]
