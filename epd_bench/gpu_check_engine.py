"""The paged engine on one checkpoint on the device: what `make gpu-check` records per family.

    python -m epd_bench.gpu_check_engine --model DIR [--device cuda] [--steps 32] [--hbm-gbps GB/s] --json

- K/V plan at --gpu-memory-utilization 0.9 (decoder_service/engine/memory_plan.py, after its profiling forward):
  blocks, bytes per token, and the sequences of 1,024 and of 4,096 tokens the pool holds at once.
- CUDA graphs captured for decode (decoder_service/engine/cuda_graphs.py; the block size is 16 when torch's
  FlashAttention pages 16-position blocks, else 256, its paged minimum), and how many decode steps replayed them.
- TPOT at batch 1: the mean of --steps decode steps of one row (a 32-token prompt), timed between device syncs,
  against the HBM bound: the LM's weight bytes / the device's bandwidth (a constant per device name, or --hbm-gbps).
- Output tokens/s with 64 rows in flight: 64 rows decoding --steps steps together (prefill not counted).
- The tensor-parallel code path at size 1 (`--tp-path`; the machine has one GPU, so N > 1 cannot run there): a process
  group of one (NCCL on CUDA) with the split's hooks and collectives, against the plain path, both eager: the greedy
  tokens of --steps decode steps equal, and TPOT at batch 1 of each.
- With `--spec`, speculative decoding and chunked prefill on the same runner (epd_bench/gpu_check_spec.py, at most
  SPEC_STEPS timed steps per number): verification ÷ plain decode at 1 and 16 rows, the n-gram proposer's host
  time, a step of 16 decode rows with a prompt chunk (the new default's and the old 32 tokens) ÷ a decode-only step.
On CPU (the dry run) the same numbers without graphs or a bound. `run_engine` is gpu-check's step {family}/engine.
"""
from __future__ import annotations

import json
import time
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd_bench.gpu_check_spec import measure_spec, spare_tokens
from epd_bench.micro import emit, parser, sync

if TYPE_CHECKING:  # the run imports them (torch and the engine), after --help has answered
    import torch

    from decoder_service.config import DecoderConfig
    from decoder_service.engine.model_runner import ModelRunner
    from epd_bench.gpu_check_run import Run
    from epd_models.halves import LanguageHalf

# HBM bandwidth by device name (vendor data sheets: H200 SXM 4.8 TB/s, H100 SXM 3.35 TB/s); others need --hbm-gbps
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
ROWS = 64  # in flight for the throughput number
PROMPT_TOKENS = 32
TP_FAMILY = "qwen2.5-vl-3b"  # its engine step also runs the tensor-parallel path at size 1 (NCCL) against the plain one
LIMIT_S = 150.0  # gpu-check's engine step, per family
SPEC_STEPS = 16  # timed steps per number of gpu_check_spec (5-15 s of the engine step on a GPU, estimated)


def run_engine(run: Run, family: str, model_dir: Path) -> None:
    """gpu-check's step {family}/engine: this module in a process of its own on --device."""
    with run.step(f"{family}/engine", f"engine-{family}.log") as rec:
        args = ["-m", "epd_bench.gpu_check_engine", "--model", str(model_dir), "--device", run.args.device, "--json",
                "--spec", *(("--steps", "4") if run.args.size == "small" else ()),
                *(("--tp-path",) if family == TP_FAMILY else ())]
        rec["result"] = json.loads(run.python(rec, f"engine-{family}.log", args, LIMIT_S).strip().splitlines()[-1])
        if run.args.device.startswith("cuda") and not rec["result"]["graph_replays"]:
            raise RuntimeError("no decode step replayed a CUDA graph")
        if family == TP_FAMILY and not rec["result"]["tp_path"]["tokens_equal"]:
            raise RuntimeError("the tensor-parallel path at size 1 changed the tokens")
        if "error" in rec["result"]["spec"]:
            raise RuntimeError(f"speculative decoding / chunked prefill: {rec['result']['spec']['error']}")


def bandwidth(device_name: str, override_gbps: float | None) -> float | None:
    if override_gbps:
        return override_gbps * 1e9
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in device_name), None)


def block_size(device: torch.device) -> int:
    from decoder_service.engine.cuda_attention import paged_supported

    return 16 if device.type != "cuda" or paged_supported(16, str(device)) else 256


def runner_for(lm: LanguageHalf, cfg: DecoderConfig, num_blocks: int, max_len: int) -> tuple[ModelRunner, Any]:
    from decoder_service.engine.cuda_graphs import DecodeGraphs, packed_forward
    from decoder_service.engine.model_runner import ModelRunner

    runner = ModelRunner(lm, ROWS, max_len, chunk=1 << 30, prefix_block=cfg.block_size, num_blocks=num_blocks)
    graphs = DecodeGraphs(lm, runner.cache, ROWS, max_len, packed_forward(lm, runner.cache, runner.inputs.dummy_mask),
                          enforce_eager=cfg.enforce_eager)
    graphs.capture()
    setattr(runner, "graphs", graphs)  # noqa: B010  # ModelRunner's hook: decode steps replay its graphs
    return runner, graphs


def timed_decode(runner: ModelRunner, lm: LanguageHalf, rows: int, steps: int) -> float:
    """Seconds per decode step of `rows` rows (after prefilling their prompts and two warm-up steps)."""
    import torch

    from decoder_service.prompt import Prompt

    vocab = lm.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(rows)
    for i in range(rows):
        ids = torch.randint(10, vocab - 10, (1, PROMPT_TOKENS), generator=gen)
        runner.add(("r", rows, i), Prompt(ids, []))
    feed: dict[Hashable, int] = {k: int(torch.argmax(v)) for k, v in runner.prefill(1 << 30).items()}
    for step in range(steps + 2):
        if step == 2:
            sync(lm.device)
            started = time.perf_counter()
        runner.grow(feed)
        logits = runner.decode(feed)
        feed = dict(zip(logits, torch.stack(list(logits.values())).argmax(-1).tolist(), strict=True))
    sync(lm.device)
    elapsed = time.perf_counter() - started
    for key in list(runner.rows):
        runner.remove(key)
    return elapsed / steps


def measure(model: str, device: str, steps: int, hbm_gbps: float | None, spec: bool = False) -> dict[str, Any]:
    from decoder_service.config import DecoderConfig
    from epd_models.halves import LanguageHalf

    lm = LanguageHalf(model, device=device)
    step_tokens = DecoderConfig(model=model, max_num_seqs=ROWS).num_batched_tokens  # the engine's default budget
    result, runner = measure_lm(lm, steps, hbm_gbps, spare_tokens(steps, step_tokens) if spec else 0)
    if spec:
        try:  # the engine's numbers above are kept whatever happens here
            result["spec"] = measure_spec(runner, lm, min(steps, SPEC_STEPS), step_tokens)
        except Exception as exc:  # noqa: BLE001 - recorded; run_engine fails the step after keeping the result
            result["spec"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def measure_lm(lm: LanguageHalf, steps: int, hbm_gbps: float | None, spare: int = 0
               ) -> tuple[dict[str, Any], ModelRunner]:
    """The numbers for a loaded LM, and the runner they were measured with (epd_bench/gpu_check_quant.py decodes
    on it again, graphs and all); on CPU its pool has room for `spare` more positions."""
    import torch

    from decoder_service.config import DecoderConfig
    from decoder_service.engine.memory_plan import module_bytes, plan_engine

    cfg = DecoderConfig(model=str(lm.model_dir), block_size=block_size(lm.device), max_num_seqs=ROWS)
    plan = plan_engine(cfg, lm)
    max_len = min(plan.max_model_len, 8192)  # the runs here are short; the plan's own length is reported
    # CPU: only the blocks these runs need (the plan's share of RAM is reported, not allocated)
    need = ROWS * -(-(PROMPT_TOKENS + steps + 4) // plan.block_size) + 1 + -(-spare // plan.block_size)
    runner, graphs = runner_for(lm, cfg, plan.num_blocks if lm.device.type == "cuda" else need, max_len)
    weights = module_bytes(lm.module)
    name = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu"
    bw = bandwidth(name, hbm_gbps)
    tpot = timed_decode(runner, lm, 1, steps)
    per_step = timed_decode(runner, lm, ROWS, steps)
    return {"device": name, "dtype": str(lm.dtype).removeprefix("torch."), "weight_bytes": weights,
            "block_size": plan.block_size, "num_blocks": plan.num_blocks, "bytes_per_token": plan.bytes_per_token,
            "pool_bytes": plan.pool_bytes, "max_model_len": plan.max_model_len, "plan": plan.source,
            "sequences_1024": plan.max_tokens // 1024, "sequences_4096": plan.max_tokens // 4096,
            "graphs": sorted(graphs.graphs), "graph_replays": graphs.num_replays,
            "tpot_b1_ms": round(tpot * 1e3, 3), "hbm_bound_ms": round(weights / bw * 1e3, 3) if bw else None,
            "tpot_over_bound": round(tpot / (weights / bw), 2) if bw else None,
            f"tokens_per_s_{ROWS}": round(ROWS / per_step, 1), "steps": steps}, runner


def eager_tokens(lm: LanguageHalf, steps: int) -> tuple[list[int], float]:
    """Greedy tokens of one row decoding `steps` steps without graphs, and seconds per step (after two)."""
    import torch

    from decoder_service.engine.model_runner import ModelRunner
    from decoder_service.prompt import Prompt

    size = block_size(lm.device)
    runner = ModelRunner(lm, 1, PROMPT_TOKENS + steps + 8, chunk=1 << 30, prefix_block=size,
                         num_blocks=-(-(PROMPT_TOKENS + steps + 8) // size) + 1)
    vocab = lm.config.get_text_config().vocab_size
    runner.add("row", Prompt(torch.randint(10, vocab - 10, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)),
                             []))
    token = int(torch.argmax(runner.prefill(1 << 30)["row"]))
    tokens = [token]
    for step in range(steps + 2):
        if step == 2:
            sync(lm.device)
            started = time.perf_counter()
        runner.grow({"row": token})
        token = int(torch.argmax(runner.decode({"row": token})["row"]))
        tokens.append(token)
    sync(lm.device)
    return tokens, (time.perf_counter() - started) / steps


def tp_path(model: str, device: str, steps: int) -> dict[str, Any]:
    """The tensor-parallel path at size 1 against the plain path: tokens equal, TPOT of each (ms), the backend."""
    import torch

    from decoder_service.engine.tp.load import load_language
    from decoder_service.engine.tp.ranks import backend_for
    from epd_models.halves import LanguageHalf

    plain = LanguageHalf(model, device=device)
    want, plain_s = eager_tokens(plain, steps)
    del plain
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    lm = load_language(model, dtype="auto", device=device, quantized="auto", tp_path=True)
    try:
        got, tp_s = eager_tokens(lm, steps)
    finally:
        assert lm.ranks is not None
        lm.ranks.close()
    return {"backend": backend_for(lm.device), "tokens_equal": got == want, "steps": steps,
            "tpot_plain_ms": round(plain_s * 1e3, 3), "tpot_tp_path_ms": round(tp_s * 1e3, 3),
            "tpot_ratio": round(tp_s / plain_s, 3)}


def main(argv: list[str] | None = None) -> None:
    p = parser("gpu_check_engine", __doc__, "print the result as one JSON line")
    p.add_argument("--model", required=True, help="a checkpoint directory")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per number (default: %(default)s)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="the device's HBM bandwidth in GB/s, for devices not in HBM_BYTES_PER_S")
    p.add_argument("--tp-path", action="store_true",
                   help="also the tensor-parallel code path at size 1 against the plain path (result['tp_path'])")
    p.add_argument("--spec", action="store_true",
                   help="also speculative decoding and chunked prefill on the same runner (result['spec'])")
    args = p.parse_args(argv)
    import torch

    with torch.inference_mode():
        result = measure(args.model, args.device, args.steps, args.hbm_gbps, args.spec)
        if args.tp_path:
            result["tp_path"] = tp_path(args.model, args.device, args.steps)
    emit(result, True, indent=None if args.json else 1)


if __name__ == "__main__":
    main()
