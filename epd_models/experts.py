"""Mixture-of-experts weights published one tensor per expert (`...mlp.experts.<e>.gate_proj.weight`, as the FP8
releases of Qwen3-VL-MoE write them) into the fused 3-D parameters transformers' expert modules hold
(`gate_up_proj` (experts, 2 x intermediate, hidden) and `down_proj` (experts, hidden, intermediate))."""
from __future__ import annotations

import re
from collections.abc import Container

import torch

PER_EXPERT = re.compile(r"(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def fuse_experts(state: dict[str, torch.Tensor], params: Container[str]) -> None:
    """Replace per-expert weights in `state` by the fused parameters the module in `params` has (in place).
    ValueError names the expert whose tensor is missing or misshapen."""
    found: dict[str, dict[tuple[str, int], str]] = {}
    for key in list(state):
        m = PER_EXPERT.fullmatch(key)
        if m and f"{m['base']}.gate_up_proj" in params:
            found.setdefault(m["base"], {})[(m["proj"], int(m["e"]))] = key
    for base, keys in found.items():
        count = 1 + max(e for _, e in keys)
        rows = []
        for e in range(count):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if (proj, e) not in keys:
                    raise ValueError(f"tensor {base}.{e}.{proj}.weight is missing ({count} experts found)")
            rows.append([state.pop(keys[(p, e)]) for p in ("gate_proj", "up_proj", "down_proj")])
        try:
            state[f"{base}.gate_up_proj"] = torch.stack([torch.cat([g, u], 0) for g, u, _ in rows])
            state[f"{base}.down_proj"] = torch.stack([d for _, _, d in rows])
        except RuntimeError as exc:
            raise ValueError(f"tensors {base}.*: per-expert shapes disagree: {exc}") from None
