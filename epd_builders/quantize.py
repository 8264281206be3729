"""Turn an unquantized checkpoint into a quantized one in a published format, plus its dequantized twin.

    python -m epd_builders.quantize --src /tmp/tiny-qwen --format awq --out /tmp/tiny-qwen-awq --twin /tmp/twin

Only the language model's decoder-layer projections (q/k/v/o_proj, gate/up/down_proj) are quantized; embeddings,
lm_head, norms, the vision tower, projectors and an MoE router stay as they are. The twin holds the dequantized
weights in the original dtype and no quantization_config, so serving `out` and serving `twin` must agree.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from epd_builders import quant_formats as qf

FORMATS = ("fp8", "ct-fp8", "ct-w4a16", "awq", "gptq")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INDEX = "model.safetensors.index.json"


def build_quantized(src: Path, fmt: str, out: Path, twin: Path, group_size: int | None = None, seed: int = 0) -> None:
    """Write the quantized checkpoint to out and its dequantized twin to twin (seed: unused, quantization is
    deterministic round-to-nearest; kept so callers can vary it once a format needs randomness)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    src, out, twin = Path(src), Path(out), Path(twin)
    group = group_size or 128
    shapes = _shapes(src)
    prefix = lm_prefix(shapes)
    targets = {k for k, s in shapes.items() if is_target(k, s, prefix)}
    if not targets:
        raise ValueError(f"no decoder-layer linears under {prefix!r} in {src}")
    for d in (out, twin):
        _copy_tree(src, d)
    scheme = qf.ct_scheme(fmt, group) if fmt.startswith("ct-") else None
    experts = _moe_experts(shapes, prefix) if fmt == "fp8" else set()
    dims = _moe_dims(src) if experts else (0, 0)
    renamed: dict[str, list[str]] = {}
    for shard in sorted(src.glob("*.safetensors")):
        renamed.update(_convert_shard(shard, fmt, group, scheme, targets, experts, out, twin, dims))
    skipped = skip_list(shapes, prefix, targets | experts)
    _fix_index(out, renamed)
    _write_config(out, fmt, group, scheme, skipped, ct_ignore(skipped, shapes, prefix))
    _drop_quant_config(twin)


def _shapes(src: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            shapes.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def lm_prefix(shapes: dict[str, Any]) -> str:
    """The language model's key prefix, found by its token embedding (`<prefix>embed_tokens.weight`), which
    separates it from vision towers that also have `.layers.` (e.g. LLaVA's CLIP `vision_tower.encoder.layers`)."""
    found = [k.removesuffix("embed_tokens.weight") for k in shapes if k.endswith("embed_tokens.weight")]
    if len(found) != 1:
        raise ValueError(f"expected one language-model embed_tokens.weight, found {found}")
    return found[0]


def is_target(key: str, shape: list[int], prefix: str) -> bool:
    """A 2-D projection weight inside the LM's decoder layers (an MoE router `mlp.gate` is not a projection)."""
    pat = rf"{re.escape(prefix)}layers\.\d+\.(?:[\w.]+\.)?(?:{'|'.join(PROJECTIONS)})\.weight"
    return len(shape) == 2 and re.fullmatch(pat, key) is not None


def _moe_experts(shapes: dict[str, list[int]], prefix: str) -> set[str]:
    """Fused 3-D expert tensors (`...mlp.experts.gate_up_proj` / `down_proj`) of the LM's decoder layers."""
    pat = rf"{re.escape(prefix)}layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)"
    return {k for k, s in shapes.items() if len(s) == 3 and re.fullmatch(pat, k)}


def skip_list(shapes: dict[str, list[int]], prefix: str, done: set[str]) -> list[str]:
    """Module names (checkpoint naming) holding a linear-like 2-D/3-D weight left unquantized: a decoder-layer
    module by its full name (an MoE router), anything else by its first name component outside the LM prefix
    (`lm_head`, `visual`, `model.visual`, `vision_tower`, `multi_modal_projector`). Embeddings are not linears.
    `lm_head` is always listed: with tied embeddings (gemma3) the model has that Linear but no tensor for it."""
    lm_parts = prefix.rstrip(".").split(".") if prefix else []
    names: set[str] = set()
    for key, shape in shapes.items():
        if key in done or len(shape) not in (2, 3) or "embed" in key:
            continue
        module = key.removesuffix(".weight") if key.endswith(".weight") else key.rsplit(".", 1)[0]
        if module.startswith(prefix + "layers."):
            names.add(module)
            continue
        parts = module.split(".")
        n = next((i for i, p in enumerate(parts) if i >= len(lm_parts) or p != lm_parts[i]), len(parts) - 1)
        names.add(".".join(parts[: n + 1]))
    if not any(n.rsplit(".", 1)[-1] == "lm_head" for n in names):
        names.add("lm_head")
    return sorted(names)


def ct_ignore(skipped: list[str], shapes: dict[str, Any], prefix: str) -> list[str]:
    """compressed-tensors `ignore` entries for the skipped modules, as `re:` patterns that match both the
    checkpoint's names and transformers' runtime names (e.g. `visual.` on disk is `model.visual.` at run time),
    in the style of llm-compressor releases ("re:.*lm_head", "re:.*mlp.gate$", "re:visual.*")."""
    pats = []
    for name in skipped:
        if name.startswith(prefix + "layers."):
            pats.append(f"re:.*{re.escape(name[len(prefix):])}$")
        else:
            leaf = f"{name}.weight" in shapes or name == "lm_head"
            pats.append(f"re:.*{re.escape(name.split('.')[-1])}" + ("$" if leaf else r"\..*"))
    return pats


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy every non-weight file; weight shards are rewritten by _convert_shard."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
        elif f.is_dir():
            shutil.copytree(f, dst / f.name, dirs_exist_ok=True)


def _convert_shard(shard: Path, fmt: str, group: int, scheme: object, targets: set[str], experts: set[str],
                   out: Path, twin: Path, moe_dims: tuple[int, int] = (0, 0)) -> dict[str, list[str]]:
    """Rewrite one shard into out (quantized) and twin (dequantized); return {replaced key: its new keys}."""
    with safe_open(shard, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    q_out, q_twin, renamed = dict(tensors), dict(tensors), {}
    for key in sorted(targets & tensors.keys()):
        module = key.removesuffix(".weight")
        res = _quantize(tensors[key], fmt, group, scheme)
        del q_out[key]
        new = {f"{module}.{name}": t.contiguous() for name, t in res.tensors.items()}
        q_out.update(new)
        renamed[key] = list(new)
        q_twin[key] = res.dequant.to(tensors[key].dtype)
    biases = {t.removesuffix("weight") + "bias" for t in targets} if fmt in ("awq", "gptq") else set()
    for key in biases & tensors.keys():  # wherever the shard split put them
        q_out[key] = tensors[key].to(torch.float16)  # AWQ and GPTQ store a quantized linear's bias in float16
        q_twin[key] = q_out[key].to(tensors[key].dtype)
    for key in sorted(experts & tensors.keys()):
        renamed[key] = _split_experts(key, tensors, group, moe_dims, q_out, q_twin)
    save_file(q_out, out / shard.name, metadata=meta)
    save_file(q_twin, twin / shard.name, metadata=meta)
    return renamed


def _quantize(w: torch.Tensor, fmt: str, group: int, scheme: object) -> qf.Quantized:
    if fmt == "fp8":
        return qf.fp8_block(w, group)
    if fmt == "awq":
        return qf.awq_gemm(w, group)
    if fmt == "gptq":
        return qf.gptq_v1(w, group)
    return qf.ct_compress(w, fmt, scheme)


def _split_experts(key: str, tensors: dict[str, torch.Tensor], block: int, dims: tuple[int, int],
                   q_out: dict[str, torch.Tensor], q_twin: dict[str, torch.Tensor]) -> list[str]:
    """Replace a fused expert tensor by one FP8 tensor per expert in out, by its dequantized values in the twin."""
    base = key.rsplit(".", 1)[0]
    per_expert, deq = qf.fp8_experts(tensors[key], key.endswith("down_proj"), dims, block)
    del q_out[key]
    q_out.update({f"{base}.{name}": t for name, t in per_expert.items()})
    q_twin[key] = deq.to(tensors[key].dtype)
    return [f"{base}.{name}" for name in per_expert]


def _moe_dims(src: Path) -> tuple[int, int]:
    """(hidden, expert intermediate) of the text model, which fix the fused experts' orientation."""
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text["hidden_size"]), int(text["moe_intermediate_size"])


def _fix_index(out: Path, renamed: dict[str, list[str]]) -> None:
    """A sharded checkpoint's index maps each new tensor to the shard of the tensor it replaced; its total_size
    becomes the quantized tensors' bytes."""
    index = out / INDEX
    if not index.exists():
        return
    data = json.loads(index.read_text())
    wmap = data["weight_map"]
    for old, new in renamed.items():
        shard = wmap.pop(old)
        wmap.update({k: shard for k in new})
    data["weight_map"] = dict(sorted(wmap.items()))
    total = 0
    for shard in sorted(set(wmap.values())):
        with safe_open(out / shard, "pt") as f:
            total += sum(t.nelement() * t.element_size() for t in (f.get_tensor(k) for k in f.keys()))
    data.setdefault("metadata", {})["total_size"] = total
    index.write_text(json.dumps(data, indent=2) + "\n")


def _write_config(out: Path, fmt: str, group: int, scheme: object, skipped: list[str], ignore: list[str]) -> None:
    if fmt.startswith("ct-"):
        _write_ct_config(out, fmt, scheme, ignore)
        return
    qc: dict[str, Any]
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [group, group], "modules_to_not_convert": skipped}
    elif fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True,
              "modules_to_not_convert": skipped}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_ct_config(out: Path, fmt: str, scheme: object, ignore: list[str]) -> None:
    """The config block as compressed-tensors writes it (ModelCompressor.update_config, as llm-compressor does)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=qf.ct_format_name(fmt),
                            quantization_status=QuantizationStatus.COMPRESSED,
                            ignore=ignore)
    ModelCompressor(quantization_config=qc).update_config(str(out))


def _drop_quant_config(twin: Path) -> None:
    cfg = json.loads((twin / "config.json").read_text())
    if cfg.pop("quantization_config", None) is not None:
        (twin / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m epd_builders.quantize", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, type=Path, help="unquantized checkpoint directory")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, type=Path, help="directory for the quantized checkpoint")
    p.add_argument("--twin", required=True, type=Path, help="directory for the dequantized twin")
    p.add_argument("--group-size", type=int, default=None, help="group / block size (default 128)")
    args = p.parse_args(argv)
    build_quantized(args.src, args.format, args.out, args.twin, args.group_size)
    print(args.out)


if __name__ == "__main__":
    main()
