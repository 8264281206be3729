"""epd_bench.paged_attention: every path it times computes the same attention, and it reports each one."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from epd_bench import paged_attention
from epd_bench.paged_attention import BLOCK, DIM, KV_HEADS


def test_the_engines_gather_reads_each_rows_blocks_in_order() -> None:
    rows, width = 3, 4
    pool = torch.randn(KV_HEADS, rows * width + 1, BLOCK, DIM)
    table = (torch.randperm(rows * width) + 1).view(rows, width)
    kept = torch.empty(KV_HEADS, rows * width, BLOCK, DIM)
    torch.index_select(pool, 1, table.reshape(-1), out=kept)
    got = kept.view(KV_HEADS, rows, width * BLOCK, DIM).transpose(0, 1)
    want = torch.stack([torch.cat([pool[:, b] for b in table[r].tolist()], dim=1) for r in range(rows)])
    assert torch.equal(got, want)
    q = torch.randn(rows, 8, 1, DIM)
    assert torch.allclose(F.scaled_dot_product_attention(q, got, got, enable_gqa=True),
                          F.scaled_dot_product_attention(q, want.contiguous(), want.contiguous(), enable_gqa=True),
                          atol=1e-6)


def test_it_reports_every_path_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    paged_attention.main(["--json", "--rows", "2", "4", "--positions", "32", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out)
    assert [r["rows"] for r in out] == [2, 4]
    for row in out:
        assert {"slots_sdpa_ms", "gather_fresh_ms", "gather_kept_ms", "paged_head_major_ms",
                "paged_block_major_ms"} <= set(row) and all(v >= 0 for v in row.values())
