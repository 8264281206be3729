"""epd_builders.quantize against the published formats, checked with code written here from the formats'
descriptions (unpacking, grids, packing orders), with compressed-tensors, and with transformers' own loaders.

Error bounds (round-to-nearest, so half a quantization step):
- FP8 e4m3 (3 mantissa bits): a normal value rounds within 2^-4 of itself; below 2^-6 (subnormals, step 2^-9) within
  2^-10; in weight units, |w' - w| <= 2^-4 |w| + 2^-10 s, s being the block's / channel's scale (amax / 448).
- int4 (AWQ, GPTQ, compressed-tensors W4A16): |w' - w| <= s / 2 inside the grid, and each format's grid covers its
  group (GPTQ/CT: symmetric around amax, AWQ: [min, max] with a rounded zero point). AWQ and GPTQ store s in float16,
  which moves the grid's edge by up to 15 * 2^-11 steps, so a clamped extreme may be off by up to
  (1/2 + 15 * 2^-11) s: measured 0.5047 s on the tiny qwen2_5_vl.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from epd_builders import tiny
from epd_builders.quantize import FORMATS, build_quantized, main

GROUP = 32
FAMILIES = ("qwen2_5_vl", "llava")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VISION = ("visual.", "vision_tower.", "multi_modal_projector.")


class Built(dict[tuple[str, str], tuple[Path, Path]]):
    """(family, format) -> (quantized dir, twin dir) of tiny models with a 128-wide LM, built on first use."""
    def __init__(self, root: Path):
        super().__init__()
        self.root, self.src = root, dict[str, Path]()

    def source(self, family: str) -> Path:
        if family not in self.src:
            spec = tiny.TinySpec(family=family, text_hidden=128, lm_scale=3.0)
            self.src[family] = tiny.build_tiny(spec, self.root / family)
        return self.src[family]

    def __missing__(self, key: tuple[str, str]) -> tuple[Path, Path]:
        self[key] = (self.root / "-".join(key), self.root / ("-".join(key) + "-twin"))
        build_quantized(self.source(key[0]), key[1], *self[key], group_size=GROUP)
        return self[key]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("quant_builders"))


def _targets(sd: dict[str, torch.Tensor]) -> set[str]:
    """The LM decoder-layer projections, by this test's own reading of the key names."""
    return {k.removesuffix(".weight") for k, t in sd.items() if t.dim() == 2 and ".layers." in k
            and not k.startswith(VISION) and k.removesuffix(".weight").rsplit(".", 1)[-1] in PROJ}


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Unpack int32 words into eight 4-bit values each, nibble j (bits 4j..4j+3) at index 8c+j along dim."""
    u = packed.to(torch.int64) & 0xFFFFFFFF
    parts = [(u >> (4 * j)) & 0xF for j in range(8)]
    return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)


def _fp8(sd: dict[str, torch.Tensor], m: str, w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize with a per-element scale map; return (dequant, bound)."""
    assert sd[f"{m}.weight"].dtype == torch.float8_e4m3fn
    return sd[f"{m}.weight"].float() * scale, 2**-4 * w.abs() + 2**-10 * scale


def _dequant(fmt: str, sd: dict[str, torch.Tensor], m: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize module m of a quantized state dict from the format's description; return it and the bound."""
    out, inn = w.shape
    if fmt == "fp8":
        s = sd[f"{m}.weight_scale_inv"]
        assert s.dtype == torch.float32 and list(s.shape) == [-(-out // GROUP), -(-inn // GROUP)]
        blocks = w.reshape(out // GROUP, GROUP, inn // GROUP, GROUP).abs().amax(dim=(1, 3))
        torch.testing.assert_close(s, blocks / 448, rtol=1e-6, atol=0)
        return _fp8(sd, m, w, s.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1))
    if fmt == "ct-fp8":
        s = sd[f"{m}.weight_scale"]
        assert list(s.shape) == [out, 1]
        return _fp8(sd, m, w, s.float().expand(out, inn))
    if fmt == "ct-w4a16":
        assert sd[f"{m}.weight_shape"].tolist() == [out, inn] and list(sd[f"{m}.weight_packed"].shape) == [out, inn // 8]
        q = _nibbles(sd[f"{m}.weight_packed"], 1).float() - 8  # stored offset by 2^(bits-1)
        s = sd[f"{m}.weight_scale"].float().repeat_interleave(GROUP, 1)
        return q * s, s / 2
    scales = sd[f"{m}.scales"]
    assert scales.dtype == torch.float16 and list(scales.shape) == [inn // GROUP, out]
    s = scales.float().repeat_interleave(GROUP, 0)  # [inn, out]
    if fmt == "awq":
        order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # inverse of the GEMM order [0, 2, 4, 6, 1, 3, 5, 7]
        unorder = lambda x: x.reshape(x.shape[0], -1, 8)[:, :, order].flatten(1)  # noqa: E731
        q = unorder(_nibbles(sd[f"{m}.qweight"], 1))
        z = unorder(_nibbles(sd[f"{m}.qzeros"], 1)).repeat_interleave(GROUP, 0)
    else:
        assert torch.equal(sd[f"{m}.g_idx"], (torch.arange(inn) // GROUP).to(torch.int32))
        q = _nibbles(sd[f"{m}.qweight"], 0)
        z = _nibbles(sd[f"{m}.qzeros"], 1)[sd[f"{m}.g_idx"].long()] + 1  # v1 stores zero - 1
        assert (z == 8).all()  # symmetric
    return ((q - z).float() * s).t(), s.t() * (0.5 + 15 * 2**-11)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensors_and_twin(built: Built, family: str, fmt: str) -> None:
    """out = src with the LM projections replaced by the format's tensors (everything else byte-identical); the
    twin = src with those weights dequantized from exactly the stored tensors, within the format's step."""
    out, twin = built[family, fmt]
    src = load_file(built.source(family) / "model.safetensors")
    q, tw = load_file(out / "model.safetensors"), load_file(twin / "model.safetensors")
    targets = _targets(src)
    assert len(targets) == 14 and set(src) == set(tw) and {k.rsplit(".", 1)[0] for k in set(q) ^ set(src)} == targets
    for key, t in src.items():
        module, leaf = key.rsplit(".", 1)
        if module in targets and (leaf == "weight" or fmt in ("awq", "gptq")):
            continue
        assert tw[key].dtype == t.dtype and torch.equal(tw[key], t), key
        assert q[key].dtype == t.dtype and torch.equal(q[key], t), key
    for m in sorted(targets):
        w = src[f"{m}.weight"].float()
        deq, bound = _dequant(fmt, q, m, w)
        assert tw[f"{m}.weight"].dtype == src[f"{m}.weight"].dtype
        assert torch.equal(tw[f"{m}.weight"].float(), deq), m
        assert ((deq - w).abs() <= bound * (1 + 1e-5) + 1e-7).all(), m
        assert not torch.equal(deq, w)
        if f"{m}.bias" in src and fmt in ("awq", "gptq"):
            assert q[f"{m}.bias"].dtype == torch.float16 and torch.equal(q[f"{m}.bias"].float(), tw[f"{m}.bias"])
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    assert {f.name for f in built.source(family).iterdir()} == {f.name for f in out.iterdir()}


@pytest.mark.parametrize("fmt", ["ct-fp8", "ct-w4a16"])
def test_ct_config_validates(built: Built, fmt: str) -> None:
    """compressed-tensors parses the config block and reads the published scheme from it."""
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((built["qwen2_5_vl", fmt][0] / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(qc)
    scheme = cfg.config_groups["group_0"]
    assert qc["quant_method"] == "compressed-tensors" and cfg.quantization_status == "compressed"
    w, act = scheme.weights, scheme.input_activations
    assert scheme.targets == ["Linear"] and w.symmetric and not w.dynamic
    fp8 = fmt == "ct-fp8"
    assert cfg.format == scheme.format == ("float-quantized" if fp8 else "pack-quantized")
    assert (w.type, w.num_bits, w.strategy, w.group_size) == (("float", 8, "channel", None) if fp8 else
                                                              ("int", 4, "group", GROUP))
    assert (act.type, act.strategy, act.dynamic, act.symmetric) == ("float", "token", True, True) if fp8 else not act


def _load(path: Path, forward: bool = False, **kw: object) -> dict[str, torch.Tensor]:
    """A checkpoint's weights as transformers loads them (forward: run one step first, which is when the
    compressed-tensors route decompresses)."""
    from transformers import AutoModelForImageTextToText

    model: Any
    info: dict[str, Any]
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True, **kw)  # type: ignore[misc]
    assert not any(info.values()), info
    if forward:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    return model.state_dict()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # it is how one asks to dequantize
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["fp8", "ct-fp8", "ct-w4a16"])
def test_transformers_loads_like_twin(built: Built, family: str, fmt: str) -> None:
    """transformers' own loaders (dequantizing on CPU) give exactly the twin's weights."""
    from transformers import CompressedTensorsConfig, FineGrainedFP8Config

    out, twin = built[family, fmt]
    cfg = FineGrainedFP8Config(dequantize=True) if fmt == "fp8" else CompressedTensorsConfig(dequantize=True)
    got, want = _load(out, quantization_config=cfg), _load(twin)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("family", [*FAMILIES, "gemma3"])  # gemma3: a tied lm_head, a Linear with no tensor of its own
@pytest.mark.parametrize("fmt", ["ct-fp8", "ct-w4a16"])
def test_compressed_tensors_route_honours_ignore(built: Built, family: str, fmt: str) -> None:
    """Loaded compressed (compressed-tensors applies config_groups/ignore to transformers' module names, which
    differ from the checkpoint's), the vision tower and lm_head stay dense and the first forward's decompression
    gives the twin's weights."""
    out, twin = built[family, fmt]
    got, want = _load(out, forward=True), _load(twin)
    dense = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "lm_head.")
    assert not any(k.startswith(dense) and "scale" in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_cli_sharded(built: Built, tmp_path: Path) -> None:
    """The CLI writes what the function writes, from a sharded source too (the index names each new tensor's
    shard, and a bias apart from its weight is still stored as the format says); abbreviations are refused."""
    src, index = load_file(built.source("qwen2_5_vl") / "model.safetensors"), "model.safetensors.index.json"
    shutil.copytree(built.source("qwen2_5_vl"), tmp_path / "src", ignore=shutil.ignore_patterns("*.safetensors"))
    halves = {"a.safetensors": sorted(src)[::2], "b.safetensors": sorted(src)[1::2]}
    for f, keys in halves.items():
        save_file({k: src[k] for k in keys}, tmp_path / "src" / f, metadata={"format": "pt"})
    wmap = {k: f for f, keys in halves.items() for k in keys}
    (tmp_path / "src" / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wmap}))
    main(["--src", str(tmp_path / "src"), "--format", "gptq", "--out", str(tmp_path / "o"),
          "--twin", str(tmp_path / "t"), "--group-size", str(GROUP)])
    ref, idx = load_file(built["qwen2_5_vl", "gptq"][0] / "model.safetensors"), json.loads((tmp_path / "o" / index).read_text())
    shards = {f: load_file(tmp_path / "o" / f) for f in halves}
    got = {k: shards[f][k] for k, f in idx["weight_map"].items()}
    assert set(got) == set(ref) and all(ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]) for k in ref)
    assert idx["metadata"]["total_size"] == sum(t.nelement() * t.element_size() for t in ref.values())
    with pytest.raises(SystemExit):
        main(["--src", "x", "--form", "gptq", "--out", "o", "--twin", "t"])


def _transposed_copy(src: Path, dst: Path) -> Path:
    """src with its fused expert tensors in the original releases' orientation ([E, hidden, 2*inter] ...)."""
    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    save_file({k: t.transpose(1, 2).contiguous() if ".experts." in k else t for k, t in sd.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.skipif("qwen3_vl_moe" not in tiny.FAMILIES, reason="no tiny qwen3_vl_moe builder")
def test_fp8_moe_experts_one_tensor_each(built: Built, tmp_path: Path) -> None:
    """FP8 MoE: each expert's gate/up/down as its own [out, in] FP8 tensor + scale grid, from either orientation of
    the fused tensors; the router and everything else untouched; the twin keeps the fused tensors, dequantized."""
    src_dir = built.source("qwen3_vl_moe")
    text = json.loads((src_dir / "config.json").read_text())["text_config"]
    hidden, inter = text["hidden_size"], text["moe_intermediate_size"]
    runs = {}
    for name, d in (("as saved", src_dir), ("transposed", _transposed_copy(src_dir, tmp_path / "t"))):
        build_quantized(d, "fp8", tmp_path / f"{name}-q", tmp_path / f"{name}-tw", group_size=GROUP)
        runs[name] = load_file(tmp_path / f"{name}-q" / "model.safetensors")
    assert set(runs["as saved"]) == set(runs["transposed"])
    assert all(torch.equal(runs["as saved"][k].float(), runs["transposed"][k].float()) for k in runs["as saved"])
    src, q = load_file(src_dir / "model.safetensors"), runs["as saved"]
    tw = load_file(tmp_path / "as saved-tw" / "model.safetensors")
    assert set(tw) == set(src)
    fused = [k for k in src if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused and not any(k in q for k in fused)
    for key in fused:
        base, down = key.rsplit(".", 1)[0], key.endswith("down_proj")
        assert list(src[key].shape[1:]) == ([hidden, inter] if down else [2 * inter, hidden])  # as saved: [out, in]
        for e in range(src[key].shape[0]):
            rows = {"down_proj": src[key][e]} if down else {"gate_proj": src[key][e][:inter],
                                                           "up_proj": src[key][e][inter:]}
            got = []
            for name, w in rows.items():
                deq, bound = _dequant("fp8", q, f"{base}.{e}.{name}", w.float())
                assert ((deq - w).abs() <= bound * (1 + 1e-5) + 1e-7).all()
                got.append(deq)
            assert torch.equal(tw[key][e], torch.cat(got))
    routers = [k for k in src if k.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(q[k], src[k]) and torch.equal(tw[k], src[k]) for k in routers)
    qc = json.loads((tmp_path / "as saved-q" / "config.json").read_text())["quantization_config"]
    assert {k.removesuffix(".weight") for k in routers} <= set(qc["modules_to_not_convert"])


def test_fp8_matches_compressed_tensors_dequantizer(built: Built, tmp_path: Path) -> None:
    """compressed-tensors' FP8-block checkpoint dequantizer (which pads partial edge tiles) reproduces the twin,
    at the published block 128 (the tiny k/v_proj are 64 x 128: one partial tile) and at GROUP."""
    from compressed_tensors.entrypoints.convert.converters import FP8BlockDequantizer

    for block in (128, GROUP):
        out, twin = tmp_path / f"q{block}", tmp_path / f"t{block}"
        build_quantized(built.source("qwen2_5_vl"), "fp8", out, twin, group_size=None if block == 128 else block)
        deq = FP8BlockDequantizer.from_pretrained(out, weight_block_size=(block, block), dtype=torch.float32)
        got, want = deq.process(load_file(out / "model.safetensors")), load_file(twin / "model.safetensors")
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), block


def test_awq_matches_compressed_tensors_converter(built: Built) -> None:
    """compressed-tensors' AutoAWQ converter (its own unpacking and reverse order) turns the AWQ tensors into
    pack-quantized ones whose decompression is the twin (up to float16 rounding: it multiplies in the scales'
    float16, the twin in float32)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    out, twin = built["llava", "awq"]
    conv = AutoAWQConverter.from_autoawq_config(json.loads((out / "config.json").read_text())["quantization_config"])
    ct = conv.process(load_file(out / "model.safetensors"))
    scheme = conv.update_config(None).config_groups["config_group_0"]
    want = load_file(twin / "model.safetensors")
    modules = [k.removesuffix(".weight_packed") for k in ct if k.endswith(".weight_packed")]
    assert len(modules) == 14
    for m in modules:
        local = {k.rsplit(".", 1)[1]: t for k, t in ct.items() if k.rsplit(".", 1)[0] == m}
        w = BaseCompressor.get_value_from_registry("pack-quantized").decompress(local, scheme)["weight"]
        torch.testing.assert_close(w.float(), want[f"{m}.weight"], rtol=2**-10, atol=0)
