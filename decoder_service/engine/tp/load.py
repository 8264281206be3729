"""The decoder's language model at any tensor-parallel size: at 1 the plain LanguageHalf; above, rank 0's share with
the other ranks started beside it (each loading its own share while rank 0 loads), joined and attached as `lm.ranks`."""
from __future__ import annotations

from pathlib import Path

import torch

from decoder_service.engine.tp.ranks import COLLECTIVE_TIMEOUT_S, Ranks
from epd_models.device import resolve_device
from epd_models.halves import LanguageHalf


def load_language(model_dir: str | Path, *, dtype: str, device: str, quantized: str, size: int = 1,
                  timeout_s: float = COLLECTIVE_TIMEOUT_S, tp_path: bool = False) -> LanguageHalf:
    """RankStartError (one line) when a rank cannot start; SplitError when the model does not split over `size`.
    `tp_path` at size 1: the tensor-parallel code path with one rank (a process group of one, its collectives, the
    split's hooks), which `make gpu-check` compares with the plain path."""
    if size == 1 and not tp_path:
        return LanguageHalf(model_dir, dtype, device, quantized)
    where = resolve_device(device)
    threads = 0
    if where.type == "cpu":  # the ranks share the host's cores
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
    ranks = Ranks.spawn(str(model_dir), size, dtype=dtype, device=where, quantized=quantized, threads=threads,
                        timeout_s=timeout_s)
    try:
        lm = LanguageHalf(model_dir, dtype, where, quantized, tp_rank=0, tp_size=size, tp_path=tp_path)
        ranks.connect()
    except BaseException:
        ranks.kill()
        raise
    lm.ranks = ranks
    return lm
