"""CUDA graphs for decode steps (decoder_service/engine/cuda_graphs.py): the buckets, the padding of a step up to
its bucket, and (on CPU, no capture) that a padded step gives the real rows the eager step's logits. With
`--device cuda` (make gpu-check) the captured graphs run the engine and give the CPU path's greedy tokens."""
from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest
import torch

from decoder_service.engine.cuda_attention import row_lengths
from decoder_service.engine.cuda_graphs import PAD_SLOT, DecodeGraphs, StaticInputs, bucket_for, buckets, packed_forward
from decoder_service.engine.model_runner import ModelRunner
from epd_models.halves import LanguageHalf
from tests.decoder_service.test_batch import prompts


def test_buckets_are_vllms_up_to_the_first_that_holds_max_num_seqs() -> None:
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets(30) == [1, 2, 4, 8, 16, 24, 32] and buckets(3) == [1, 2, 4] and buckets(1) == [1]
    assert buckets(100_000)[-1] == 512 and len(buckets(100_000)) == 3 + 64


@pytest.mark.parametrize(("rows", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (32, 32), (33, None)])
def test_a_step_takes_the_smallest_bucket_that_holds_it(rows: int, bucket: int | None) -> None:
    assert bucket_for(rows, buckets(32)) == bucket


def test_padding_rows_write_the_null_slot_and_read_one_position_of_the_null_block() -> None:
    static = StaticInputs.empty(8, 4, (3, 1), 5, torch.float32, torch.device("cpu"))
    static.fill(8, torch.ones(1, 6, 4), torch.full((3, 1, 6), 7), torch.arange(10, 16), torch.full((6, 5), 9),
                torch.full((6,), 20, dtype=torch.int32))  # a step of 6 rows leaves stale values in rows 0..5
    static.fill(4, torch.full((1, 3, 4), 2.0), torch.full((3, 1, 3), 5), torch.tensor([40, 41, 42]),
                torch.tensor([[3, 4], [5, 0], [6, 7]]), torch.tensor([7, 2, 8], dtype=torch.int32))
    assert static.slots[:4].tolist() == [40, 41, 42, PAD_SLOT] and static.used[:4].tolist() == [7, 2, 8, 1]
    assert static.table[:4].tolist() == [[3, 4, 0, 0, 0], [5, 0, 0, 0, 0], [6, 7, 0, 0, 0], [0] * 5]
    assert static.embeds[0, :3].eq(2).all() and static.embeds[0, 3].eq(0).all()
    assert static.positions[..., :3].eq(5).all() and static.positions[..., 3].eq(0).all()
    plan = static.plan(4, 16, None)
    meta = getattr(plan, "varlen")  # noqa: B009
    assert plan.slots.data_ptr() == static.slots.data_ptr() and plan.groups[0].num_q == 4
    assert meta.cu_seq_q.tolist() == [0, 1, 2, 3, 4] and (meta.max_q, meta.max_k) == (1, 5 * 16)
    assert meta.block_table.data_ptr() == static.table.data_ptr() and meta.block_table.shape == (4, 5)


def _decode_feed(runner: ModelRunner, n: int, lm: LanguageHalf, all_prompts: list) -> dict[Hashable, int]:
    for i, prompt in enumerate(all_prompts[:n]):
        runner.add(i, prompt)
    feed = {k: int(torch.argmax(v)) for k, v in runner.prefill(4096).items()}
    runner.grow(feed)
    return feed


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_decode_step_padded_to_its_bucket_gives_the_real_rows_the_eager_logits(
        tiny_model_dirs: dict[str, Path], family: str) -> None:
    lm, all_prompts = prompts(tiny_model_dirs[family])
    runner = ModelRunner(lm, max_slots=8, max_len=1024, chunk=1024)
    feed = _decode_feed(runner, 3, lm, all_prompts)
    runner.inputs.split_decode = False  # a CUDA step's plan: its decode rows in one group
    segments = runner._decode_segments(feed)  # in the plan's row order
    plan, embeds, positions = runner.inputs.plan(segments, feed)
    graphs = DecodeGraphs(lm, runner.cache, 8, 1024, packed_forward(lm, runner.cache, runner.inputs.dummy_mask))
    assert not graphs.enabled and graphs.run(plan, embeds, positions) is None  # CPU: eager, never captured
    group = plan.groups[0]
    graphs.static.fill(4, embeds, positions, plan.slots, group.table, row_lengths(group))
    with torch.inference_mode():
        padded = graphs.step(4)
    assert padded.shape[0] == 4
    for pool in (runner.cache.paged_layers[0].keys, runner.cache.paged_layers[0].values):
        assert pool is not None and pool[:, 0].eq(0).all()  # the padding row's K/V left the null block
    eager = runner.decode(feed)  # the same K/V written again, then the unpadded forward
    for i, segment in enumerate(segments):
        torch.testing.assert_close(padded[i], eager[segment.row.key], rtol=1e-4, atol=1e-4)


def _greedy(lm: LanguageHalf, all_prompts: list, graphs: bool, block: int) -> tuple[list[list[int]], int]:
    runner = ModelRunner(lm, max_slots=4, max_len=1024, chunk=512, prefix_block=block)
    captured = None
    if graphs:
        captured = DecodeGraphs(lm, runner.cache, 4, 1024, packed_forward(lm, runner.cache, runner.inputs.dummy_mask))
        captured.capture()
        setattr(runner, "graphs", captured)  # noqa: B010  # the runner's hook: decode steps replay its graphs
    feed = _decode_feed(runner, 4, lm, all_prompts)
    out: dict[Hashable, list[int]] = {k: [t] for k, t in feed.items()}
    for _ in range(10):
        feed = {k: int(torch.argmax(v)) for k, v in runner.decode(feed).items()}
        for k, t in feed.items():
            out[k].append(t)
    return [out[k] for k in sorted(out, key=str)], captured.num_replays if captured is not None else 0


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_paged_cuda_path_with_graphs_gives_the_cpu_paths_greedy_tokens(
        tiny_model_dirs: dict[str, Path], family: str, device: str) -> None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        pytest.skip("needs --device cuda (make gpu-check)")
    cpu, cpu_prompts = prompts(tiny_model_dirs[family])
    want, _ = _greedy(cpu, cpu_prompts, graphs=False, block=16)
    gpu = LanguageHalf(tiny_model_dirs[family], dtype=torch.bfloat16, device=device)
    gpu_prompts = [p for p in cpu_prompts]
    eager, _ = _greedy(gpu, gpu_prompts, graphs=False, block=256)
    graphed, replays = _greedy(gpu, gpu_prompts, graphs=True, block=256)
    assert graphed == eager and replays == 10  # graphs replay every decode step, token for token the eager path
    agree = sum(a == b for w, g in zip(want, graphed, strict=True) for a, b in zip(w, g, strict=True))
    assert agree >= 0.9 * sum(len(w) for w in want), (want, graphed)  # bf16 on CUDA against float32 on CPU
