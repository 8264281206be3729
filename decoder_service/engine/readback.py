"""Every row's sampled token to the host in one transfer, each row's bad choice failing that row alone."""
from __future__ import annotations

import torch


def read_back(chosen: dict[int, torch.Tensor], vocab_size: int,
              batch: tuple[list[int], torch.Tensor] | None = None) -> dict[int, int | Exception]:
    """Each row's token id, or why its choice is not one. One transfer (one sync) for all rows: the 0-d tensors of
    `chosen` and `batch`, the tokens of a batched choice (row keys, one 1-D integer tensor) read back with them.

    A choice that is not a 0-d integer tensor fails its own row before the transfer, so it cannot spoil (or
    promote) the others' tokens.
    """
    good = {k: t for k, t in chosen.items() if _is_token_tensor(t)}
    values: dict[int, object] = {k: ValueError(f"sampler returned {_describe(t)}, not a 0-d integer tensor")
                                 for k, t in chosen.items() if k not in good}
    keys, tensors = (list(batch[0]), [batch[1]]) if batch is not None else ([], [])
    if good:
        keys[:0], tensors[:0] = list(good), [torch.stack(list(good.values()))]
    if tensors:
        try:
            values.update(zip(keys, torch.cat(tensors).tolist(), strict=True))
        except Exception:  # e.g. rows on different devices: read each alone
            values.update((k, _scalar(t)) for k, t in good.items())
            values.update(_each(batch))
    out = {key: _token(values[key], vocab_size) for key in chosen}
    for key in batch[0] if batch is not None else ():  # an integer tensor's tolist(): ints, or an error
        v = values[key]
        out[key] = v if type(v) is int and 0 <= v < vocab_size else _token(v, vocab_size)
    return out


def _token(value: object, vocab_size: int) -> int | Exception:
    if isinstance(value, Exception):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return ValueError(f"sampler chose {value!r}, not a token id in [0, {vocab_size})")


def _is_token_tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.is_floating_point() or t.is_complex()
                                                                or t.dtype == torch.bool)


def _describe(t: object) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _each(batch: tuple[list[int], torch.Tensor] | None) -> list[tuple[int, object]]:
    if batch is None:
        return []
    try:
        return list(zip(batch[0], batch[1].tolist(), strict=True))
    except Exception as exc:
        return [(k, exc) for k in batch[0]]


def _scalar(t: torch.Tensor) -> object:
    try:
        return t.item()
    except Exception as exc:
        return exc


def read_back_rows(rows: dict[int, torch.Tensor]) -> dict[int, list[float]]:
    """Each row's 1-D float tensor as a list, all in one transfer (rows with logprobs: one sync, not one per row)."""
    if not rows:
        return {}
    try:
        flat = torch.cat([t.float().flatten() for t in rows.values()]).tolist()
    except Exception:  # noqa: BLE001 - e.g. rows on different devices: each row reads itself back later
        return {}
    out, start = {}, 0
    for key, t in rows.items():
        out[key], start = flat[start:start + t.numel()], start + t.numel()
    return out
