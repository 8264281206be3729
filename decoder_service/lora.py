"""LoRA adapters on the decoder, as vLLM's flags: `--enable-lora`, `--lora-modules name=path` (or the JSON form
`{"name": ..., "path": ..., "base_model_name": ...}`), `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`.

A request names its adapter in `lora` (the proxy's `model`); its rows then run with that adapter's linears
(epd_models/lora/layers.py), its prefix-cache chain is salted with the adapter's name (a block computed under one
adapter is never reused under another), and every other request in the step keeps its own adapter or the base.
With --enable-lora-runtime-updating, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies)
add and remove adapters while streams run (decoder_service/lora_routes.py): a load reads only folders inside
--allowed-lora-dir. Up to --max-cpu-loras adapters are kept in host memory, --max-loras of them resident in the
linears; a request for one that is not resident evicts the least recently used one no request holds, or waits for
one (epd_models/lora/layers.py `LoRASet.acquire`)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decoder_service.lora_defaults import PREFIX, default_folders, is_reserved, loaded_names, mm_loras_argument
from epd_common.lora_flags import RANKS, lora_module_argument
from epd_common.startup import ConfigError

if TYPE_CHECKING:
    from epd_models.halves import LanguageHalf
    from epd_models.lora.layers import LoRASet

def add_lora_flags(p: argparse.ArgumentParser, d: Any) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) on the language "
                   "model: a request selects one by its name in `model`; rows of different adapters share steps")
    g.add_argument("--lora-modules", type=lora_module_argument, nargs="+", default=[],
                   help="adapters to serve: name=path, or JSON {\"name\", \"path\", \"base_model_name\"}")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters resident in the linears at once; a request for another evicts the least recently "
                        "used one no request holds (or waits for one)")
    g.add_argument("--max-lora-rank", type=int, choices=RANKS, default=d.max_lora_rank,
                   help="the largest rank an adapter may have; a larger one is refused")
    g.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                   help="adapters kept in host memory, resident or not: --lora-modules and runtime loads together "
                        "(0: --max-loras)")
    g.add_argument("--enable-lora-runtime-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters at runtime "
                        "(behind the internal key; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    g.add_argument("--default-mm-loras", type=mm_loras_argument, default=d.default_mm_loras,
                   help="vLLM's JSON {modality: adapter folder}: requests naming no adapter and holding that modality "
                        "(image, video, audio) run under it; default: the checkpoint's own (Phi-4-multimodal's "
                        "speech-lora and vision-lora); '{}': none")
    g.add_argument("--allowed-lora-dir", default=d.allowed_lora_dir,
                   help="the folder runtime loads may read adapters from (symlinks resolved); unset: every runtime "
                        "load is refused")


def check_lora_flags(cfg: Any) -> None:
    """ConfigError for LoRA flags that cannot work together, before any weight is read."""
    if cfg.lora_modules and not cfg.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if cfg.max_loras < 1 or cfg.max_cpu_loras < 0:
        raise ConfigError("--max-loras must be >= 1 and --max-cpu-loras >= 0")
    if cfg.max_cpu_loras and cfg.max_cpu_loras < cfg.max_loras:
        raise ConfigError(f"--max-cpu-loras {cfg.max_cpu_loras} must be >= --max-loras {cfg.max_loras} (vLLM's rule)")
    if len(cfg.lora_modules) > max(cfg.max_loras, cfg.max_cpu_loras):
        raise ConfigError(f"{len(cfg.lora_modules)} --lora-modules but --max-cpu-loras {cfg.max_cpu_loras or 0} "
                          f"(0: --max-loras {cfg.max_loras}) adapters are kept in host memory; raise --max-cpu-loras")
    names = [m.name for m in cfg.lora_modules]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora-modules: a name given twice in {names}")
    if any(is_reserved(n) for n in names):
        raise ConfigError(f"--lora-modules: names starting {PREFIX!r} are the modality defaults' (--default-mm-loras)")
    if cfg.enable_lora_runtime_updating and not cfg.enable_lora:
        raise ConfigError("--enable-lora-runtime-updating needs --enable-lora")
    if cfg.enable_lora and cfg.tensor_parallel_size > 1:
        raise ConfigError("--enable-lora with --tensor-parallel-size > 1 is not supported yet")


def attach_loras(lm: LanguageHalf, cfg: Any) -> LoRASet | None:
    """Read and check every --lora-modules adapter, and the modality defaults (decoder_service/lora_defaults.py),
    against `lm` and add them to its linears (LoRAError if one is refused); None when there are none to serve."""
    names, folders = loaded_names(default_folders(lm.model_dir, lm.adapter.spec.shipped_loras, cfg.default_mm_loras))
    if not cfg.enable_lora and not folders:
        return None
    from epd_models.lora.peft_format import LoRAError, linear_shapes, read_adapter

    if folders and cfg.tensor_parallel_size > 1:
        raise LoRAError(f"the checkpoint's modality adapters ({sorted(names)}) with --tensor-parallel-size > 1 "
                            "are not supported yet; --default-mm-loras '{}' serves without them")
    from epd_models.lora.layers import LoRASet

    shapes = linear_shapes(lm.module)
    adapters = [read_adapter(m.name, Path(m.path), family=lm.adapter, shapes=shapes, max_rank=cfg.max_lora_rank,
                             dtype=lm.dtype, base_model_name=m.base_model_name, vision=None if cfg.aggregated else False)
                for m in cfg.lora_modules]
    adapters += [read_adapter(name, folder, family=lm.adapter, shapes=shapes, max_rank=RANKS[-1], dtype=lm.dtype)
                 for name, folder in folders.items()]
    from decoder_service.engine import cpu_linear

    resident, known = (cfg.max_loras, max(cfg.max_loras, cfg.max_cpu_loras)) if cfg.enable_lora else (0, 0)
    lm.lora = LoRASet(lm.module, [], resident + len(folders), lm.dtype,
                      pack=cpu_linear.wanted(cfg.cpu_exact_linear, lm.device), max_cpu_loras=known + len(folders))
    lm.lora.defaults = names
    for adapter in adapters[len(cfg.lora_modules):] + adapters[: len(cfg.lora_modules)]:  # defaults resident first
        lm.lora.add(adapter)
    lm.lora.bind(())
    return lm.lora


def load_at_runtime(lm: LanguageHalf, cfg: Any, name: str, path: str) -> None:
    """Read, check and add adapter `name` from `path` inside --allowed-lora-dir (LoRAError naming why not)."""
    from epd_models.lora.peft_format import LoRAError, linear_shapes, read_adapter

    assert lm.lora is not None
    if cfg.allowed_lora_dir is None:
        raise LoRAError("runtime loads need --allowed-lora-dir (the folder adapters may be read from)")
    if name in lm.lora.known:
        raise LoRAError(f"adapter {name!r} is already loaded")
    if is_reserved(name) or not cfg.enable_lora:
        raise LoRAError(f"adapter {name!r}: runtime loads need --enable-lora, and a name not starting {PREFIX!r}")
    adapter = read_adapter(name, Path(path), family=lm.adapter, shapes=linear_shapes(lm.module),
                           max_rank=cfg.max_lora_rank, dtype=lm.dtype, root=Path(cfg.allowed_lora_dir), vision=None)
    lm.lora.add(adapter)


def lora_salt(cache_salt: str, lora: str) -> str:
    """The prefix-cache salt of a request under adapter `lora` ("" the base model: its own salt unchanged)."""
    return f"{cache_salt}\x00lora:{lora}" if lora else cache_salt
