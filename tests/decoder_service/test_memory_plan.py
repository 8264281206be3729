"""The K/V plan a decoder starts with: real-size 7B checkpoints (built on meta, no weights drawn) on 24 and 80 GiB
GPUs, the CPU default, and the refusals with their numbers, down to `epd-decoder` exiting 2."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from decoder_service.cli import parse_args
from decoder_service.engine.kv_shape import KVShape
from decoder_service.engine.memory_plan import KVPlan, KVPlanError, module_bytes, plan_kv_cache
from epd_builders.full_size import LLAVA_7B, QWEN25_VL_3B, config_and_processor
from epd_models.registry import adapter_for
from tests.ports import REUSE_PORT_ENV, held_port

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
# Qwen/Qwen2.5-VL-7B-Instruct's LM (its config.json): the 3B preset at the 7B's widths
QWEN25_VL_7B = replace(QWEN25_VL_3B, text_hidden=3584, text_intermediate=18944, text_layers=28, text_heads=28,
                       text_kv_heads=4, vocab_size=152064, tie_word_embeddings=False)
MODELS = {"qwen2.5-vl-7b": (QWEN25_VL_7B, torch.bfloat16), "llava-1.5-7b": (LLAVA_7B, torch.float16)}


@functools.cache
def meta_lm(name: str) -> tuple[KVShape, int, int]:
    """(K/V shape, weight bytes, checkpoint max positions) of a real-size LM built on meta, as the decoder builds it."""
    spec, dtype = MODELS[name]
    cfg = config_and_processor(spec)[0]
    lm = adapter_for(cfg).build_language(cfg)
    assert {p.device.type for p in lm.parameters()} == {"meta"}  # nothing drawn
    text = cfg.get_text_config()
    return KVShape.of(text, dtype), module_bytes(lm, dtype), int(text.max_position_embeddings)


def gpu_plan(name: str, total: int, max_len: int = 0, **kw: Any) -> KVPlan:
    """The plan on a GPU of `total` bytes at the defaults, with the weights as the only memory used (a real start
    adds the profiling forward's peak)."""
    shape, weights, positions = meta_lm(name)
    args: dict[str, Any] = dict(block_size=16, requested_max_len=max_len, checkpoint_max_len=positions,
                                kv_cache_memory=0, device=CUDA, gpu_memory_utilization=0.9, total_bytes=total,
                                used_bytes=weights)
    return plan_kv_cache(shape, **{**args, **kw})


def test_real_size_7b_lms_cost_what_their_configs_say_per_token_and_in_weights() -> None:
    qwen, llava = meta_lm("qwen2.5-vl-7b"), meta_lm("llava-1.5-7b")
    assert qwen[0].bytes_per_token == 56 << 10 and llava[0].bytes_per_token == 512 << 10
    assert (qwen[2], llava[2]) == (128_000, 4096)
    assert round(qwen[1] / 2e9, 2) == 7.62 and round(llava[1] / 2e9, 2) == 6.74  # billions of parameters, 2 B each


@pytest.mark.parametrize("name,total,num_blocks,max_len", [
    # pool = 0.9 x total - weights; blocks = pool // (16 x bytes per token); one block is the null block
    ("qwen2.5-vl-7b", 24 * GiB, 8677, 128_000), ("qwen2.5-vl-7b", 80 * GiB, 67_659, 128_000),
    ("llava-1.5-7b", 24 * GiB, 1158, 4096), ("llava-1.5-7b", 80 * GiB, 7609, 4096),
])
def test_7b_checkpoints_start_with_default_flags_on_24_and_80_gib_gpus(name: str, total: int, num_blocks: int,
                                                                      max_len: int) -> None:
    """Today's slots need 32 x max positions of K/V: 235 GB (Qwen) and 64 GiB (LLaVA); the plan fits the card."""
    plan = gpu_plan(name, total)
    shape, weights, positions = meta_lm(name)
    assert (plan.num_blocks, plan.max_model_len, plan.warning) == (num_blocks, max_len, None)
    assert plan.pool_bytes == int(total * 0.9) - weights and plan.bytes_per_token == shape.bytes_per_token
    assert plan.num_blocks * plan.bytes_per_block <= plan.pool_bytes < (plan.num_blocks + 1) * plan.bytes_per_block
    assert 32 * positions * shape.bytes_per_token + weights > total * 0.9  # the old slots did not fit beside them
    assert plan.max_tokens // 1500 >= {24 * GiB: 12, 80 * GiB: 81}[total]  # 1,500-token chats held at once


def test_default_max_model_len_is_lowered_with_a_warning_when_the_pool_is_shorter() -> None:
    plan = gpu_plan("qwen2.5-vl-7b", 16 * GiB)  # 14.4 GiB usable, 14.2 GiB of weights
    assert plan.max_model_len == plan.max_tokens == (plan.num_blocks - 1) * 16 < 128_000
    assert plan.warning is not None and "lowered from the checkpoint's 128000 to " + str(plan.max_model_len) \
        in plan.warning and "57344 bytes (56 KiB) per token" in plan.warning


def test_an_explicit_max_model_len_that_cannot_fit_is_refused_with_the_numbers() -> None:
    fits = gpu_plan("llava-1.5-7b", 24 * GiB).max_tokens  # 18,512 tokens
    assert gpu_plan("llava-1.5-7b", 24 * GiB, max_len=fits).max_model_len == fits  # exactly what fits is taken
    with pytest.raises(KVPlanError) as exc:
        gpu_plan("llava-1.5-7b", 24 * GiB, max_len=fits + 1)
    pool = int(24 * GiB * 0.9) - meta_lm("llava-1.5-7b")[1]
    for number in ("524288 bytes (512 KiB) per token", f"{pool} bytes", f"{fits} tokens", f"that fits is {fits}",
                   "--gpu-memory-utilization 0.9"):
        assert number in str(exc.value)


def test_kv_cache_memory_overrides_the_utilization_and_must_be_free() -> None:
    plan = gpu_plan("qwen2.5-vl-7b", 80 * GiB, kv_cache_memory=4 * GiB)
    assert plan.pool_bytes == 4 * GiB and plan.num_blocks == 4 * GiB // (16 * 56 << 10)
    with pytest.raises(KVPlanError, match="more than the 9.81 GiB free on cuda"):
        gpu_plan("qwen2.5-vl-7b", 24 * GiB, kv_cache_memory=10 * GiB)


def test_a_pool_without_room_for_one_block_beside_the_null_block_is_refused() -> None:
    block = 16 * (56 << 10)
    assert gpu_plan("qwen2.5-vl-7b", 80 * GiB, kv_cache_memory=2 * block).max_model_len == 16
    with pytest.raises(KVPlanError, match="holds no block of 16 tokens"):
        gpu_plan("qwen2.5-vl-7b", 80 * GiB, kv_cache_memory=2 * block - 1)
    with pytest.raises(KVPlanError, match="holds no block"):  # the weights take the whole 0.9
        gpu_plan("qwen2.5-vl-7b", 15 * GiB)


def test_the_cpu_default_is_a_quarter_of_ram_and_never_past_ram_less_the_weights() -> None:
    shape = meta_lm("qwen2.5-vl-7b")[0]
    args: dict[str, Any] = dict(block_size=16, requested_max_len=0, checkpoint_max_len=128_000, kv_cache_memory=0,
                                device=CPU, gpu_memory_utilization=0.9)
    assert plan_kv_cache(shape, **args, total_bytes=64 * GiB, used_bytes=1 * GiB).pool_bytes == 16 * GiB
    small = plan_kv_cache(shape, **args, total_bytes=16 * GiB, used_bytes=meta_lm("qwen2.5-vl-7b")[1])
    assert small.pool_bytes == int(16 * GiB * 0.9) - meta_lm("qwen2.5-vl-7b")[1] and small.warning is not None
    explicit = plan_kv_cache(shape, **{**args, "kv_cache_memory": 1 * GiB}, total_bytes=64 * GiB, used_bytes=0)
    assert explicit.pool_bytes == 1 * GiB and explicit.source == "--kv-cache-memory 1073741824"


def test_kv_cache_memory_takes_units_and_prefix_block_size_stays_an_alias(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EPD_INSECURE", "1")
    assert parse_args(["--kv-cache-memory", "4GiB"]).kv_cache_memory == 4 * GiB
    assert parse_args(["--kv-cache-memory", "1.5 GB"]).kv_cache_memory == 1_500_000_000
    assert parse_args(["--kv-cache-memory", "123"]).kv_cache_memory == 123
    assert parse_args(["--prefix-block-size", "8"]).block_size == 8 == parse_args(["--block-size", "8"]).block_size
    assert parse_args(["--block-size", "8", "--prefix-block-size", "8"]).prefix_block_size == 8
    for argv, why in ((["--kv-cache-memory", "4 GiBs"], "not a byte size"),
                      (["--kv-cache-memory", "-1"], "not a byte size"),
                      (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
                      (["--block-size", "16", "--prefix-block-size", "8"], "disagree")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.e2e
def test_epd_decoder_exits_2_with_the_numbers_when_max_model_len_cannot_fit(tiny_model_dirs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    model = tiny_model_dirs["llava"]
    per_token = KVShape.of(AutoConfig.from_pretrained(model).get_text_config(), torch.float32).bytes_per_token
    fits = (64 * 1024 // (16 * per_token) - 1) * 16
    env = {**os.environ, "PYTHONPATH": str(REPO), **REUSE_PORT_ENV}
    with held_port() as port:
        proc = subprocess.run([sys.executable, "-m", "decoder_service.cli", "--model", str(model), "--port",
                               str(port), "--insecure", "--kv-cache-memory", "64KiB", "--max-model-len", "4096"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("epd-decoder: error: --max-model-len 4096 needs")
    assert f"{per_token} bytes per token" in last and "65536 bytes" in last and f"{fits} tokens" in last
