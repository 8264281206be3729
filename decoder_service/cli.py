"""The `epd-decoder` command line: flags -> config -> the worker's HTTP server."""
from __future__ import annotations

import argparse

from connector.control.curve_flags import GROUP, add_curve_flags, curve_gaps, pop_curve
from decoder_service.config import DecoderConfig
from decoder_service.engine.spec.config import spec_config_argument
from decoder_service.lora import add_lora_flags
from decoder_service.preflight import check_before_loading
from epd_common.cli import Gap, byte_size, fraction, key_gaps, refuse_open, run_refusable, worker_parser
from epd_common.startup import run_main
from epd_common.tracing import add_tracing_flags
from epd_models.audio_jobs import add_audio_flags
from epd_models.device_flags import add_device_flags, add_quant_flags
from epd_models.video_config import add_video_flags

PROG = "epd-decoder"


def build_parser() -> argparse.ArgumentParser:
    """Every epd-decoder flag with its default (docs/FLAGS.md is generated from it)."""
    d = DecoderConfig()
    p = worker_parser(PROG, "EPD decoder worker (language model only)", d)
    add_device_flags(p, d)
    add_quant_flags(p, d)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="positions of one sequence, prompt included (0: the model's max_position_embeddings, or a "
                        "longrope checkpoint's original_max_position_embeddings, lowered with a warning to what the "
                        "K/V pool holds; a larger value than either exits 2)")
    p.add_argument("--tensor-parallel-size", "-tp", type=_tp_size, default=d.tensor_parallel_size,
                   help="processes (one per device) the language model is split over, as vLLM's flag: attention "
                        "heads, K/V heads, MLP and experts column- then row-parallel; this process serves HTTP and "
                        "schedules, and starts the other ranks (CUDA: --device and the next N-1 devices, NCCL; "
                        "CPU: gloo). The K/V heads must divide by N")
    p.add_argument("--tensor-parallel-timeout", type=_tp_timeout, default=d.tensor_parallel_timeout,
                   help="seconds one collective between the ranks may wait (a rank that hangs): past it the decoder "
                        "exits with status 70 and is restarted with all its ranks")
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="requests waiting for a slot; more get 503")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences decoded together (an upper bound on rows per step; the K/V pool bounds them too)")
    p.add_argument("--max-seqs-per-request", type=int, default=d.max_seqs_per_request,
                   help="rows one request's n choices hold at once; its other choices are admitted as its rows free "
                        "up, and other requests are admitted past it (0: half of --max-num-seqs)")
    _add_memory_flags(p.add_argument_group("K/V memory and steps"), d)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens prefilled per engine step while streams decode (0: no cap of its own; a step "
                        "packs decode rows, then prompt chunks up to --max-num-batched-tokens, as vLLM's chunked "
                        "prefill does)")
    p.add_argument("--speculative-config", type=spec_config_argument, default=None,
                   help="speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', a draft model "
                        "'{\"model\": DIR, \"num_speculative_tokens\": 4}' (same tokenizer) or EAGLE-3 heads "
                        "'{\"method\": \"eagle3\", \"model\": DIR, ...}': each step also verifies up to k proposed "
                        "tokens per row in the same forward (greedy output unchanged, sampling keeps the model's "
                        "distribution); off while more than disable_by_batch_size sequences are in the engine")
    add_lora_flags(p, d)
    p.add_argument("--gather-timeout", type=float, default=d.gather_timeout,
                   help="seconds to gather a request's embeddings from the encoders")
    p.add_argument("--aggregated", action="store_true",
                   help="also load the vision tower and encode images sent inline (one process, no encoders)")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="aggregated mode: width x height above this is refused before decoding")
    add_video_flags(p.add_argument_group("aggregated mode: video limits"), d)
    add_audio_flags(p.add_argument_group("aggregated mode: audio limits"), d)
    p.add_argument("--engine-stall-timeout", type=float, default=d.engine_stall_timeout,
                   help="seconds the engine loop may make no progress; then /health answers 503 and the process "
                        "exits with status 70")
    p.add_argument("--grammar-compile-threads", type=int, default=d.grammar_compile_threads,
                   help="threads compiling response_format and tool-call grammars; requests without a grammar never "
                        "wait for them")
    p.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                   help="seconds one grammar compile may run; past that its request gets a 400 "
                        "schema_too_complex (a backstop: the schema's counts are bounded before compiling)")
    p.add_argument("--ec-cache-bytes", type=int, default=d.ec_cache_bytes,
                   help="bytes of gathered embeddings this decoder keeps (LRU; items mapped from an encoder's "
                        "shared memory count too, and are unmapped when evicted)")
    p.add_argument("--ec-shm", choices=("auto", "off"), default=d.ec_shm,
                   help="auto: map the embeddings of encoders on this host from shared memory (no copy; checked "
                        "by a probe, socket otherwise); off: always receive them over ZeroMQ")
    p.add_argument("--prefix-cache-bytes", type=int, default=d.prefix_cache_bytes,
                   help="bytes of prompt-prefix K/V blocks no running sequence uses, kept for reuse by later "
                        "requests (LRU, inside the K/V pool; 0 turns prefix caching off)")
    _add_handoff_flags(p.add_argument_group("prefill and decode apart (E -> P -> D)"), d)
    _add_consumer_limits(p.add_argument_group("connector limits (ZeroMQ consumer)"), d)
    add_curve_flags(p.add_argument_group(GROUP), allowed_clients=False)
    add_tracing_flags(p)
    return p


def _add_handoff_flags(g: argparse._ActionsContainer, d: DecoderConfig) -> None:
    """--role and what a prefill worker's hand-off of K/V to a decode worker needs."""
    g.add_argument("--role", choices=("both", "prefill", "decode"), default=d.role,
                   help="both: prefill and decode every request here; prefill: also prefill requests the proxy hands "
                        "off (their first token streamed, their K/V kept for a decode worker); decode: also continue "
                        "hand-offs from the K/V a prefill worker kept (prefilling here if it cannot be had)")
    g.add_argument("--kv-bind", default=d.kv_bind,
                   help="prefill: ZeroMQ endpoint decode workers fetch K/V blocks from (tcp://HOST:PORT or ipc://)")
    g.add_argument("--kv-advertise-host", default=d.kv_advertise_host,
                   help="prefill: host other machines reach --kv-bind at (when it binds 0.0.0.0)")
    g.add_argument("--kv-store-bytes", type=byte_size, default=d.kv_store_bytes,
                   help="prefill: bytes of handed-off K/V kept for pickup, e.g. 4GiB (oldest dropped first)")
    g.add_argument("--kv-ttl", type=float, default=d.kv_ttl,
                   help="prefill: seconds handed-off K/V is kept for pickup")
    g.add_argument("--handoff-min-tokens", type=int, default=d.handoff_min_tokens,
                   help="prefill: hand off only prompts with at least this many tokens not in this worker's prefix "
                        "cache; a shorter one is declined and prefills on the decode worker (0: hand off every "
                        "prompt)")


def _add_consumer_limits(g: argparse._ActionsContainer, d: DecoderConfig) -> None:
    """The bounds on what this decoder takes from the encoders (the connector's consumer side)."""
    g.add_argument("--ec-max-reply-bytes", type=int, default=d.ec_max_reply_bytes,
                   help="tensor bytes of one reply from an encoder; a larger reply is refused before it is decoded")
    g.add_argument("--ec-max-message-bytes", type=int, default=d.ec_max_message_bytes,
                   help="bytes of one tensor frame; an encoder sending a larger one is disconnected")
    g.add_argument("--ec-max-items-per-get", type=int, default=d.ec_max_items_per_get,
                   help="hashes asked of one encoder per get (keep at most the encoders' --ec-max-items-per-get)")


def parse_args(argv: list[str] | None = None) -> DecoderConfig:
    p = build_parser()
    args = p.parse_args(argv)
    _resolve_block_size(p, args, DecoderConfig())
    args.__dict__.pop("cpu_packed_linear")  # the default now: a no-op
    if args.max_prefill_tokens < 0:
        p.error("--max-prefill-tokens must be >= 0 (0: no cap of its own, the step's --max-num-batched-tokens)")
    if args.kv_store_bytes < 1 or not args.kv_ttl > 0:
        p.error("--kv-store-bytes and --kv-ttl must be > 0")
    if args.handoff_min_tokens < 0:
        p.error("--handoff-min-tokens must be >= 0")
    curve = pop_curve(p, args)
    args.lora_modules = tuple(args.lora_modules)
    cfg = DecoderConfig(**vars(args), curve=curve)
    refuse_open(p, cfg, security_gaps(cfg))
    return cfg


def _add_memory_flags(g: argparse._ActionsContainer, d: DecoderConfig) -> None:
    g.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per K/V block: the pool's unit, and a prefix is reused in whole blocks "
                        f"(default: {d.block_size})")
    g.add_argument("--prefix-block-size", type=int, default=None,
                   help="the old name of --block-size, kept so existing command lines work; both given must agree "
                        "(default: --block-size)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=d.gpu_memory_utilization,
                   help="CUDA: share of the GPU's memory for weights, activations and the K/V pool; the pool is what "
                        "is left after loading the weights and one profiling forward (vLLM's flag)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=d.kv_cache_memory,
                   help="bytes of the K/V pool, e.g. 4GiB or 4294967296 (0: on CUDA from --gpu-memory-utilization, "
                        "on CPU a quarter of RAM, at most 90%% of RAM less the weights)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens one step runs, prefill chunks and decode rows together (0: max(2048, --max-num-seqs))")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: run every step eagerly, no CUDA graphs")
    g.add_argument("--cpu-exact-linear", action="store_true",
                   help="CPU: every linear through torch.nn.functional.linear (MKL), bit-equal with transformers; by "
                        "default float32 linears run through oneDNN's prepacked weights, a gated SiLU MLP's activation "
                        "and product inside its matmuls (faster; the last bits differ, so greedy output may differ "
                        "from transformers' where two logits are that close)")
    g.add_argument("--cpu-sdpa-attention", action="store_true",
                   help="CPU: decode attention gathers K/V blocks for torch's SDPA (default: a C++ kernel, built once "
                        "per machine, reads them in place; without a compiler the gather path serves)")
    g.add_argument("--cpu-packed-linear", action="store_true", help="a no-op kept for old command lines: oneDNN's "
                   "prepacked linears are the CPU default (--cpu-exact-linear turns them off)")


def _resolve_block_size(p: argparse.ArgumentParser, args: argparse.Namespace, d: DecoderConfig) -> None:
    """--prefix-block-size is an alias of --block-size: either sets it; both must agree."""
    alias = args.__dict__.pop("prefix_block_size")
    if alias is not None and args.block_size not in (None, alias):
        p.error(f"--block-size {args.block_size} and --prefix-block-size {alias} disagree: they name one setting "
                "(the K/V pool's block, which prefixes are cached in); give one")
    args.block_size = next((v for v in (args.block_size, alias) if v is not None), d.block_size)


def _tp_size(value: str) -> int:
    n = int(value)
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{value} is not a tensor-parallel size from 1 to 64")
    return n


def _tp_timeout(value: str) -> float:
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: must be a number of seconds > 0")
    return number


def security_gaps(cfg: DecoderConfig) -> list[Gap]:
    return key_gaps(cfg) + curve_gaps(cfg)


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, _main, argv)


def _main(argv: list[str]) -> None:
    cfg = parse_args(argv)  # NOTE: before torch and transformers load: --help and usage errors answer at once
    check_before_loading(cfg)
    from decoder_service.server import create_app

    # what the K/V budget cannot hold, a refused LoRA adapter: a usage error
    run_refusable(PROG, "decoder", cfg, create_app, security_gaps(cfg), lambda app: app.state.decoder.refused)


if __name__ == "__main__":
    main()
