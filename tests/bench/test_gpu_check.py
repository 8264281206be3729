"""`python -m epd_bench.gpu_check --size small` (the CPU dry run) end to end, with a fake nvidia-smi; and its pieces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from epd_bench.gpu_check import (
    BUDGET_S,
    EXTRA_MIN_S,
    FAMILIES,
    LIMITS,
    SMALL_WORKLOADS,
    junit_counts,
    on_device,
    parse_args,
)
from epd_bench.gpu_check_engine import TP_FAMILY
from epd_bench.gpu_check_quant import MIN_LEFT_S, parity, run_quant
from epd_bench.gpu_check_report import BEGIN, END, write_section
from epd_bench.gpu_check_run import Run
from epd_bench.gpu_check_spec import DRAFT_FAMILY, K, measure_spec, report_lines, spare_tokens
from epd_bench.stacks import epd
from epd_builders.full_size import preset

ROOT = Path(__file__).resolve().parents[2]
FAKE_SMI = """#!/bin/sh
case "$*" in
  *compute-apps*) echo "4242, 100"; echo "4243, 7" ;;
  *memory.used*) echo "512" ;;
  *) echo "Fake GPU, 1.0, 1024" ;;
esac
"""
SYSTEMS = ("epd-1enc", "aggregated")
HANG_GUARD_S = BUDGET_S["small"] + 100  # the dry run's own --budget stops a hung run first; this only guards that


def outside(text: str) -> str:
    """The text of a Markdown file outside its gpu-check section."""
    return text[: text.index(BEGIN)] + text[text.index(END):]


@pytest.mark.e2e
@pytest.mark.timeout(HANG_GUARD_S + 60)
def test_dry_run_serves_both_families_and_writes_only_the_marked_section(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    out, docs = tmp_path / "out", tmp_path / "BENCHMARKS.md"
    original = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    docs.write_text(original)  # a copy: the dry run never writes the real docs
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "EPD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "epd_bench.gpu_check", "--size", "small", "--device", "cpu", "--out",
                           str(out), "--write-benchmarks", str(docs)],  # the default --budget: a hang guard
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.tar.gz"]
    record = json.loads((out / "gpu_check.json").read_text())
    steps = record["steps"]
    per_family = [f"{f}/{s}" for f in FAMILIES for s in ("build", "engine", *SYSTEMS)]
    quant = ["quant-fp8", "quant-awq", "quant-moe"]
    assert list(steps) == ["env", "tests", *per_family, *quant, "bench-model", "structured", "n-prefill",
                           "encoder-batching", "lora-linears"]
    assert all(s["ok"] for s in steps.values()) and steps["env"]["gpus"] == ["Fake GPU, 1.0, 1024"]
    assert steps["tests"]["passed"] >= 2 and steps["tests"]["failed"] == steps["tests"]["errors"] == 0
    for family in FAMILIES:
        build = steps[f"{family}/build"]
        assert not build["cached"] and Path(build["path"]).parent == tmp_path / "cache" / "models"
        config = json.loads((Path(build["path"]) / "config.json").read_text())
        assert config["text_config"]["vocab_size"] == preset(family).vocab_size  # small shapes, real vocabulary
        for system in SYSTEMS:
            served = steps[f"{family}/{system}"]
            assert {name: w["result"]["completed"] for name, w in served["workloads"].items()} == {
                w.name: w.num_prompts for w in SMALL_WORKLOADS}
            assert all(w["result"]["failed"] == 0 for w in served["workloads"].values())
            assert served["gpu_mib"] == {"pid 4242": 100, "pid 4243": 7} and served["gpu_used_peak_mib"] == 512
        engine = steps[f"{family}/engine"]["result"]  # the paged engine on CPU: planned, eager, measured
        assert engine["graphs"] == [] and engine["num_blocks"] > 0 and engine["tokens_per_s_64"] > 0
        spec = engine["spec"]  # speculative decoding and chunked prefill on the same runner
        assert [v["rows"] for v in spec["verify"].values()] == [1, 16] and spec["k"] == K
        assert all(v["verify_over_decode"] > 0 and v["verify_over_eager"] > 0 for v in spec["verify"].values())
        assert spec["chunked"]["new_chunk"] == 2048 - 16 and spec["chunked"]["old_chunk"] == 32
        assert spec["chunked"]["new_over_decode"] > 0 and spec["ngram_us"]["repeated"] > 0
    tp = steps[f"{TP_FAMILY}/engine"]["result"]["tp_path"]  # the tensor-parallel path at size 1 (gloo here)
    assert tp["backend"] == "gloo" and tp["tokens_equal"] and tp["tpot_ratio"] > 0
    for fmt, kernel in (("fp8", "dequantize_per_call"), ("awq", "weight_int4pack_mm_for_cpu")):  # the CPU kernels
        q = steps[f"quant-{fmt}"]["result"]
        assert q["kernels"] == {kernel: q["kept"]["summary"]["kept"]} and q["kept"]["summary"]["dequantized"] == 0
        assert q["dequantized"]["summary"]["kept"] == 0 and q["kept_over_bf16_bytes"] < 1
        assert q["engine"]["tokens_per_s_64"] > 0 and q["parity"]["steps"] == 32 and q["parity"]["logit_scale"] > 0
    moe = steps["quant-moe"]["result"]
    assert moe["experts_modules"] > 0 and moe["parity"]["steps"] == 32 and moe["grouped_over_eager"] > 0
    structured, n_prefill = steps["structured"]["result"], steps["n-prefill"]["result"]
    assert structured["streams"] == 2 and structured["ratio"] > 0 and n_prefill["device"] == "cpu"
    batching = steps["encoder-batching"]["result"]
    assert batching["device"] == "cpu" and batching["concurrency"] == 4 and batching["batched_vs_unbatched"] > 0
    lora = steps["lora-linears"]["result"]["linears"]["q_proj"]  # the three forms compute the same sums
    assert all(lora[f]["max_diff"] < 1e-5 and lora[f]["over_base"] > 0 for f in ("mask", "loop", "grouped"))
    md = (out / "gpu_check.md").read_text()
    section = docs.read_text()[docs.read_text().index(BEGIN): docs.read_text().index(END)]
    rows = [[line for line in text.splitlines() if line.startswith("|")] for text in (md, section)]
    assert rows[0] == rows[1] and len(rows[0]) > 40  # the same tables, every number, in the docs
    for text in (md, section):
        assert "--size small --device cpu" in text and "Fake GPU" in text and record["date"] in text
        assert all(f"Serving {f}" in text for f in FAMILIES) and "## Structured outputs" in text
        assert "The paged engine on the device" in text and "| eager |" in text
        assert "Encoder batching across requests" in text
        assert "The tensor-parallel code path at size 1" in text and "| gloo | yes (4) |" in text
        assert "## Speculative decoding: a verification step (k = 4)" in text and "## Chunked prefill" in text
        assert all(f"| {f} | 16 |" in text for f in FAMILIES)  # a verification row and a chunked-prefill row each
        assert "Quantized weights at real shapes" in text and "MoE experts: transformers' eager loop" in text
        assert "| fp8 (fp8-block block 32x32) |" in text and "weight_int4pack_mm_for_cpu × " in text
        assert "| epd-1enc | 4 / 0 |" in text and "| aggregated | 2 / 0 |" in text
    assert outside(docs.read_text()) == outside(original)
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"work/pytest.log", f"work/results/{FAMILIES[0]}/epd-1enc-repeat50.json",
            f"work/logs/{FAMILIES[1]}/aggregated-decoder.log"} <= names


def test_the_dry_runs_budget_only_guards_a_hang_while_a_gpu_runs_budget_limits_and_skips(tmp_path: Path) -> None:
    """A busy machine stretches the dry run's wall time (over 500 s at load average 4-15): its fixed steps all run,
    each until the run's budget, however little of it is left; on a GPU each step keeps its limit and the feature
    benchmarks are skipped when time runs short."""
    small, full = (Run(parse_args(["--out", str(tmp_path / size), "--size", size])) for size in ("small", "full"))
    given = Run(parse_args(["--out", str(tmp_path / "given"), "--size", "small", "--budget", "30"]))
    for run in (small, full, given):
        run.scratch.rmdir()  # made empty for the small run's tiny model; nothing runs here
    assert (small.args.budget, full.args.budget) == (BUDGET_S["small"], BUDGET_S["full"]) == (1800.0, 540.0)
    assert small.timeout(LIMITS["engine"]) > LIMITS["engine"] and full.timeout(LIMITS["engine"]) == LIMITS["engine"]
    for run in (small, full):
        run.deadline = time.monotonic() + EXTRA_MIN_S / 2  # a run late in its budget
    assert not small.short_of(EXTRA_MIN_S) and full.short_of(EXTRA_MIN_S)
    assert LIMITS["engine"] > small.timeout(LIMITS["engine"]) > EXTRA_MIN_S / 2 - 5
    assert given.args.budget == 30.0 and given.record["budget_s"] == 30.0


def test_the_section_is_replaced_in_place_and_notes_failed_and_skipped_steps(tmp_path: Path) -> None:
    docs = tmp_path / "B.md"
    docs.write_text(f"# B\n\n## before\n\n{BEGIN}\nplaceholder\n{END}\n\n## after\n")
    record = {"date": "2026-12-01 10:00", "host": "h", "commit": "abc1234", "command": "python -m x", "device": "cuda",
              "size": "full", "budget_s": 540.0, "wall_s": 12.5, "workloads": {}, "steps": {
                  "env": {"ok": True, "seconds": 1.0, "gpu": "NVIDIA H200"},
                  "tests": {"ok": False, "seconds": 2.0, "error": "TimeoutError: killed"},
                  "structured": {"ok": True, "seconds": 0.0, "skip_reason": "30 s of the budget left"}}}
    for _ in range(2):  # a second write replaces the first
        write_section(docs, record)
    text = docs.read_text()
    assert text.count(BEGIN) == text.count(END) == 1 and "placeholder" not in text
    assert text.startswith("# B\n\n## before\n\n") and text.endswith(f"{END}\n\n## after\n")
    assert "NVIDIA H200" in text.splitlines()[5] and "| tests | **no** | 2.0 | TimeoutError: killed |" in text
    assert "| structured | skipped | 0.0 | 30 s of the budget left |" in text


def test_writing_benchmarks_needs_a_file_with_the_marked_section(tmp_path: Path) -> None:
    docs = tmp_path / "B.md"
    docs.write_text("# B\n\nno markers\n")
    for target in (docs, tmp_path / "missing.md"):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--out", str(tmp_path), "--write-benchmarks", str(target)])
        assert exc.value.code == 2
    assert parse_args(["--out", str(tmp_path), "--write-benchmarks", str(ROOT / "docs" / "BENCHMARKS.md")])


def test_junit_counts_names_each_failure(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="t" name="ok"/>
      <testcase classname="t" name="bad"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>
      <testcase classname="t" name="broken"><error message="boom">tb</error></testcase>
      <testcase classname="t" name="later"><skipped message="needs CUDA"/></testcase>
    </testsuite></testsuites>""")
    counts = junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert counts["failures"] == ["t::bad: assert 1 == 2", "t::broken: boom"]


def test_workers_see_only_the_device_asked_for() -> None:
    spec = epd(Path("/models/bench"), 1, cores=2, pin=False)
    assert on_device(spec, "cuda") == spec
    assert {dict(p.env)["CUDA_VISIBLE_DEVICES"] for p in on_device(spec, "cpu").procs} == {""}
    assert {dict(p.env)["CUDA_VISIBLE_DEVICES"] for p in on_device(spec, "cuda:1").procs} == {"1"}


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda1", ""])
def test_bad_device_is_a_usage_error(device: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--out", str(tmp_path), "--device", device])
    assert exc.value.code == 2


def test_quant_steps_are_skipped_with_their_reason_when_nothing_was_built_or_time_is_short(tmp_path: Path) -> None:
    run = Run(parse_args(["--out", str(tmp_path / "full"), "--size", "full"]))
    run.scratch.rmdir()
    run.deadline = time.monotonic() + MIN_LEFT_S / 2  # a GPU run late in its budget: nothing starts
    run_quant(run, None)
    steps = run.record["steps"]
    assert [steps[f"quant-{s}"]["skip_reason"] for s in ("fp8", "awq")] == ["no qwen2.5-vl-3b checkpoint was built"] * 2
    assert "fewer than" in steps["quant-moe"]["skip_reason"]
    run_quant(run, tmp_path)
    assert all("fewer than" in steps[f"quant-{s}"]["skip_reason"] for s in ("fp8", "awq", "moe"))


def test_parity_counts_equal_tokens_before_the_first_difference() -> None:
    import torch

    ref, got = torch.tensor([1.0, -4.0, 2.0]), torch.tensor([1.0, -3.0, 2.0])
    result = parity(([5, 6, 7, 8], ref), ([5, 6, 9, 8], got))
    assert result["tokens_equal_before_first_difference"] == 2 and not result["tokens_equal"]
    assert result["diff_over_scale"] == 0.25 and parity(([5], ref), ([5], ref))["tokens_equal"]


def test_spec_rows_verify_k_plus_1_positions_and_prefill_a_whole_chunk_beside_16_rows(
        tiny_model_dirs: dict[str, Path]) -> None:
    """gpu_check_spec on a tiny LLaVA on CPU: every number measured in the blocks spare_tokens asks for, every row
    given back, and the report's three tables (the draft model's stand-in cost from DRAFT_FAMILY's plain steps)."""
    import torch

    from decoder_service.engine.model_runner import ModelRunner
    from epd_models.halves import LanguageHalf

    lm, steps = LanguageHalf(tiny_model_dirs["llava"]), 2
    num_blocks = -(-spare_tokens(steps, 2048) // 16) + 1
    runner = ModelRunner(lm, 32, 4096, chunk=1 << 30, num_blocks=num_blocks)
    with torch.inference_mode():
        spec = measure_spec(runner, lm, steps, 2048)
    assert not runner.rows and runner.num_free_blocks == num_blocks - 1  # block 0: the pool's null block
    chunked = spec["chunked"]  # 16 rows; 2,048 tokens less the 16 decode rows, prefilled whole (checked inside)
    assert (chunked["rows"], chunked["new_chunk"], chunked["old_chunk"]) == (16, 2032, 32)
    assert chunked["decode_ms"] > 0 and chunked["new_over_decode"] > 0 and chunked["old_over_decode"] > 0
    for rows, v in spec["verify"].items():
        assert v["rows"] == int(rows) and v["verify_ms"] > 0 and v["decode_ms"] > 0 and v["decode_eager_ms"] > 0
    lines = report_lines({"llava": spec, DRAFT_FAMILY: spec}, "###")
    verify = spec["verify"]["16"]
    draft = round(K * verify["decode_ms"], 3)
    assert f"| llava | 16 | {verify['decode_ms']} | {verify['decode_eager_ms']} | {verify['verify_ms']} | " \
           f"{verify['verify_over_decode']} | {verify['verify_over_eager']} | {verify['verify_over_decode'] - 1:.2f} | " \
           f"{draft} | {(verify['verify_ms'] + draft) / verify['decode_ms'] - 1:.2f} |" in lines
    assert sum(line.startswith("| llava |") for line in lines) == 4  # 2 verification rows, n-gram, chunked prefill
