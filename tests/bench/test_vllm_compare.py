"""The vLLM comparison's pure parts (no vLLM here): the LM export, the prompts, the medians, ratios and targets,
the docs section, and the start-up retry when a port was taken between the pick and the bind."""
from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, AutoTokenizer, LlamaForCausalLM

from epd_bench import vllm_compare as vllm_report
from epd_bench.backends import RequestOutput
from epd_bench.completions_load import summarize, token_prompts
from epd_bench.lm_export import compare_tensors, export_lm
from epd_bench.report import write_section
from epd_bench.stacks import HOST, ProcSpec, SystemSpec, start_retrying
from epd_bench.vllm_compare import epd_system, vllm_installed, vllm_system
from epd_builders.bench_model import BENCH_PEER_SPEC, BENCH_QWEN05_SPEC, BenchQwenSpec, BenchSpec, build_bench
from epd_launcher.group import free_port

TINY = BenchSpec(vision_hidden=32, vision_intermediate=64, vision_layers=1, vision_heads=2, text_hidden=64,
                 text_intermediate=128, text_layers=2, text_heads=4, text_kv_heads=2)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bench(TINY, tmp_path_factory.mktemp("llava"))


def _bytes(path: Path, key: str) -> bytes:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return bytes(f.get_tensor(key).numpy().tobytes())


def test_the_peer_preset_has_the_notes_language_model() -> None:
    s = BENCH_PEER_SPEC
    assert (s.text_hidden, s.text_layers, s.text_heads, s.text_kv_heads, s.text_intermediate) == (1024, 6, 16, 8, 2816)


def test_the_qwen05_preset_has_qwen2_5_0_5b_s_language_model_shape() -> None:
    s = BENCH_QWEN05_SPEC
    assert (s.text_hidden, s.text_layers, s.text_heads, s.text_kv_heads, s.text_intermediate, s.text_vocab) == \
        (896, 24, 14, 2, 4864, 151936)


def test_a_vocabulary_past_the_tokenizer_s_is_muted_in_the_lm_head(tmp_path: Path) -> None:
    spec = BenchQwenSpec(**{**TINY.__dict__, "text_vocab": 1000})
    out = build_bench(spec, tmp_path / "qwen")
    vocab = len(AutoTokenizer.from_pretrained(out))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        head = f.get_tensor("language_model.lm_head.weight")
    assert vocab < 1000 == head.shape[0] and not head[vocab:].any() and head[:vocab].any()


def test_by_default_levels_reach_64_in_flight_and_epd_gets_only_the_k_v_budget() -> None:
    args = vllm_report.parse_args([])
    assert args.levels == (1, 4, 16, 64) and vllm_report.MAX_SEQS == 64
    make = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "BENCH_VLLM_EPD_FLAGS ?= --kv-cache-memory 1073741824\n" in make  # EPD's engine defaults otherwise


def test_the_export_is_the_llavas_lm_byte_for_byte_and_generates_its_greedy_tokens(llava: Path, tmp_path: Path) -> None:
    summary = export_lm(llava, tmp_path / "lm")
    with safe_open(str(llava / "model.safetensors"), "pt") as f:
        lm_keys = [k for k in f.keys() if k.startswith("language_model.")]
    assert summary["tensors_identical"] == len(lm_keys) == 3 + 9 * TINY.text_layers
    for key in lm_keys:  # read back here too, not only by the export's own check
        assert _bytes(tmp_path / "lm", key.removeprefix("language_model.")) == _bytes(llava, key), key
    lm = LlamaForCausalLM.from_pretrained(tmp_path / "lm").eval()
    vl = AutoModelForImageTextToText.from_pretrained(llava).eval()
    ids = torch.tensor([[8 + (i * 37) % 400 for i in range(40)]])
    mask = torch.ones_like(ids)
    got = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    want = vl.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert got.tolist() == want.tolist()
    tok, src_tok = AutoTokenizer.from_pretrained(tmp_path / "lm"), AutoTokenizer.from_pretrained(llava)
    chat = [{"role": "user", "content": "hello there"}]
    assert tok.apply_chat_template(chat, tokenize=False) == src_tok.apply_chat_template(chat, tokenize=False)
    assert tok("a brown fox").input_ids == src_tok("a brown fox").input_ids
    allowed = summary["prompt_token_ids"]
    assert not set(allowed) & set(src_tok.all_special_ids) and len(allowed) > 100
    assert all("\ufffd" not in tok.decode([i]) for i in allowed)


def test_a_changed_tensor_is_caught_and_a_current_export_is_reused(llava: Path, tmp_path: Path) -> None:
    dst = tmp_path / "lm"
    export_lm(llava, dst)
    stamp_time = (dst / "export.json").stat().st_mtime_ns
    assert export_lm(llava, dst)["tensors_identical"] > 0 and (dst / "export.json").stat().st_mtime_ns == stamp_time
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        compare_tensors(llava, dst)


def test_prompts_are_all_different_from_the_allowed_ids_and_seeded() -> None:
    allowed = list(range(8, 430))
    prompts = token_prompts(16, 256, allowed, seed=3)
    assert len({tuple(p) for p in prompts}) == 16 and all(len(p) == 256 and set(p) <= set(allowed) for p in prompts)
    assert token_prompts(16, 256, allowed, seed=3) == prompts != token_prompts(16, 256, allowed, seed=4)
    with pytest.raises(ValueError):
        token_prompts(3, 1, [8, 9], seed=0)  # 3 one-id prompts from 2 ids: a repeat


def _out(ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestOutput:
    return RequestOutput(success=ok, ttft=ttft, latency=latency, output_tokens=tokens if ok else 0,
                         error="" if ok else "boom")


def test_a_run_is_summarized_as_throughput_and_mean_tpot_and_ttft() -> None:
    s = summarize([_out(0.3, 2.84, 128), _out(0.1, 1.37, 128), _out(0, 0, 0, ok=False)], 4.0)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 256)
    assert s["output_tok_s"] == pytest.approx(64.0) and s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["ttfts_ms"] == [100.0, 300.0]  # each successful request's, sorted
    assert s["mean_tpot_ms"] == pytest.approx((1270 / 127 + 2540 / 127) / 2) and s["errors"] == ["boom"]


def _run(tok_s: float, tpot: float, ttft: float, failed: int = 0) -> dict[str, Any]:
    return {"output_tok_s": tok_s, "mean_tpot_ms": tpot, "mean_ttft_ms": ttft, "failed": failed, "completed": 4}


def _summary(results: dict[str, Any], skipped: dict[str, str] | None = None) -> dict[str, Any]:
    lm = {"hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 8,
          "intermediate_size": 2816, "vocab_size": 430, "lm_params": 71_672_832, "tensors_identical": 57}
    return {"date": "2026-12-02 21:00", "model": "bench-peer", "lm": lm, "cores": 2, "threads": 2, "pinned": True,
            "load_before": (1.0, 1.0, 1.0), "load_after": (2.0, 2.0, 2.0), "rounds": 3, "levels": [1, 4, 16],
            "prompt_len": 256, "output_len": 128, "context": 2048, "max_num_seqs": 16, "skipped": skipped or {},
            "startup_s": 50.0, "wall_s": 400.0, "epd_revision": None, "command": "python -m epd_bench.vllm_compare",
            "greedy_check": {"same": True}, "results": results, "medians": vllm_report.medians(results),
            "systems": {"vllm": [{"name": "vllm", "command": "env X=1 python -m vllm.entrypoints.openai.api_server"}]}}


RESULTS = {
    "1": {"epd": [_run(20, 40, 300), _run(22, 38, 280), _run(10, 80, 900)], "vllm": [_run(18, 45, 250)] * 3},
    "4": {"epd": [_run(40, 90, 900), _run(44, 85, 800), _run(42, 88, 850)],
          "vllm": [_run(90, 40, 500), _run(100, 38, 450), _run(80, 44, 520)]},
    "16": {"epd": [_run(60, 200, 2000), _run(60, 200, 2000), _run(0, 0, 0, failed=2)],
           "vllm": [_run(150, 80, 1100)] * 3},
}


def test_medians_ratios_and_targets() -> None:
    s = _summary(RESULTS)
    meds = s["medians"]
    assert meds["1"]["epd"] == {"output_tok_s": 20, "mean_tpot_ms": 40, "mean_ttft_ms": 300}  # the median round
    assert vllm_report.ratio(meds, "4", "output_tok_s") == pytest.approx(42 / 90)
    assert vllm_report.ratio(meds, "1", "mean_tpot_ms") == pytest.approx(40 / 45)
    assert meds["16"]["epd"]["output_tok_s"] is None  # a round with failures: no median, no ratio
    found = {t.name: t for t in vllm_report.targets(s)}
    assert set(found) == {"vllm_throughput_4", "vllm_throughput_16", "vllm_tpot_1", "vllm_tpot_4", "vllm_tpot_16"}
    assert found["vllm_tpot_1"].met and not found["vllm_throughput_4"].met and found["vllm_throughput_16"].value is None
    assert found["vllm_throughput_4"].op == ">=" and found["vllm_tpot_4"].op == "<=" and found["vllm_tpot_4"].limit == 1


def test_without_vllm_the_section_has_epd_alone_and_says_why() -> None:
    results = {level: {"epd": runs["epd"]} for level, runs in RESULTS.items()}
    s = _summary(results, skipped={"vllm": "not installed: runs/vllm-venv/bin/python is missing"})
    assert all(t.value is None for t in vllm_report.targets(s))
    text = vllm_report.render(s)
    assert "**vllm: left out** — not installed" in text and "| 4 | 42.0 | – | – |" in text


def test_the_section_goes_after_the_video_section_and_is_replaced_in_place(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# B\n\n<!-- video-bench:begin -->\nv\n<!-- video-bench:end -->\n\n## Hand-written\n")
    write_section(docs, "vllm-bench", vllm_report.render(_summary(RESULTS)), "video-bench")
    first = docs.read_text()
    assert first.index("<!-- video-bench:end -->") < first.index("<!-- vllm-bench:begin -->") < first.index("## Hand-written")
    assert "| 4 | 42.0 | 90.0 | 0.47 | 88.0 | 40.0 | 2.20 |" in first
    write_section(docs, "vllm-bench", vllm_report.render(_summary(RESULTS)), "video-bench")
    assert docs.read_text() == first


def test_an_epd_from_the_base_revision_gets_its_own_rows_and_leaves_the_targets_to_vllm() -> None:
    results = {level: {**runs, "epd-base": [_run(10, 100, 400)] * 3} for level, runs in RESULTS.items()}
    s = {**_summary(results), "base_revision": "0c3dcd8a" * 5}
    text = vllm_report.render(s)
    assert "### This EPD against EPD at 0c3dcd8a0c3d (`--base-revision`)" in text
    assert "| 4 | 42.0 | 10.0 | 4.20 | 0.88 | 2.12 |" in text  # tok/s, TPOT and TTFT: this EPD ÷ the base's
    assert "| 16 | – | 10.0 | – | – | – |" in text  # a level with failures: no ratio
    assert {t.name: t.value for t in vllm_report.targets(s)} == {t.name: t.value for t in vllm_report.targets(
        _summary(RESULTS))}  # the targets are still EPD ÷ vLLM


def _http_server(port: int, root: Path) -> SystemSpec:
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", HOST, "--directory", str(root))
    return SystemSpec("peer", (ProcSpec("server", argv, None, None, f"http://{HOST}:{port}"),), "m")


def test_a_system_whose_port_was_taken_is_started_again_on_a_fresh_port(tmp_path: Path) -> None:
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")  # GET /health: 200
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        ports = [taken.getsockname()[1]]

        def make() -> SystemSpec:
            spec = _http_server(ports[-1], tmp_path / "www")
            ports.append(free_port())  # the next try's
            return spec

        up, skipped = start_retrying({"peer": make}, tmp_path / "logs", timeout_s=120)
    try:
        assert skipped == {} and list(up) == ["peer"] and len(ports) == 3  # the taken port, then a fresh one
        assert up["peer"].spec.url.endswith(f":{ports[1]}")
    finally:
        for r in up.values():
            r.stop()


def test_a_system_that_fails_for_another_reason_is_left_out_with_its_log(tmp_path: Path) -> None:
    argv = (sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)")
    spec = SystemSpec("peer", (ProcSpec("server", argv, None, None, f"http://{HOST}:{free_port()}"),), "m")
    up, skipped = start_retrying({"peer": lambda: spec}, tmp_path / "logs", timeout_s=120)
    assert up == {} and "exited with 3" in skipped["peer"] and "no such model" in skipped["peer"]


def test_a_python_without_vllm_is_not_taken_for_an_install(tmp_path: Path) -> None:
    assert not vllm_installed(Path(sys.executable)) and not vllm_installed(tmp_path / "bin" / "python")


def test_both_systems_get_the_same_context_sequences_dtype_and_threads(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('dependencies = ["uvloop"]\n')
    epd = epd_system(tmp_path / "llava", 2, False, tmp_path, ("--kv-cache-memory", "1073741824"))
    vllm = vllm_system(tmp_path / "py", tmp_path / "lm", 2, True)
    dec, (peer,) = next(p for p in epd.procs if p.name == "decoder"), vllm.procs
    for argv in (dec.argv, peer.argv):
        flags = dict(zip(argv[:-1], argv[1:], strict=True))
        assert (flags["--max-model-len"], flags["--max-num-seqs"], flags["--dtype"]) == ("2048", "64", "float32")
    assert dec.threads == peer.threads == 2 and peer.cpus == (0, 1) and ("OMP_NUM_THREADS", "2") not in peer.env
    assert dec.argv[-2:] == ("--kv-cache-memory", "1073741824")
    assert all(p.argv[1] == "-P" and ("PYTHONPATH", str(tmp_path)) in p.env for p in epd.procs)  # the revision's code
    assert ("VLLM_TARGET_DEVICE", "cpu") in peer.env and peer.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
