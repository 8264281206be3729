"""disagg-epd-proxy's flags, grouped by mode: common proxy flags, launcher mode (spawn the workers here) and
attach mode (workers started elsewhere). Flags of both modes on one command line are a usage error."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from connector.control.curve_flags import add_curve_flags
from epd_common.cli import (
    add_http_flags,
    add_log_level,
    byte_size,
    cli_secret,
    env_flag,
    fraction,
    new_parser,
    non_negative,
    positive_seconds,
)
from epd_common.tracing import add_tracing_flags
from epd_common.weight_flags import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    QUANTIZED_WEIGHTS_CHOICES,
    QUANTIZED_WEIGHTS_HELP,
)
from epd_launcher.autoscale_flags import AUTOSCALE_FLAGS, add_autoscale_flags, check_autoscale
from epd_launcher.flag_types import (
    base_port,
    choice,
    default_mm_loras,
    lora_module,
    positive,
    positive_bytes,
    prefill_url,
    proxy_workers,
    speculative_config,
    tensor_parallel_size,
)
from epd_launcher.media_flags import add_audio_flags, add_image_flags, add_video_flags
from proxy.config import ProxyConfig

ATTACH_FLAGS = ("--encode-servers-urls", "--decode-servers-urls", "--prefill-servers-urls", "--dynamic-registration",
                "--insecure", "--ec-curve-key", "--ec-curve-server-key")
_UNSET: Any = object()  # a mode flag's value until the command line sets it


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


# the decoders' engine flags: (flag, type, help); passed to each spawned decoder only when given (spawn.py)
DECODER_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("--max-model-len", non_negative,
     "positions of one sequence, prompt included (0: the checkpoint's, lowered to what the decoder's K/V pool holds)"),
    ("--max-num-seqs", positive, "sequences one decoder runs at once (rows per step)"),
    ("--tensor-parallel-size", tensor_parallel_size,
     "processes each decoder and prefill worker splits the language model over (vLLM's flag; the K/V heads must "
     "divide by it); on GPUs each gets that many consecutive GPUs of its own (CUDA_VISIBLE_DEVICES), encoders "
     "round-robin over all; too few GPUs for them all exits 2 before anything starts; CPU: the ranks share it"),
    ("--tensor-parallel-timeout", positive_seconds,
     "seconds one collective between a decoder's ranks may wait (a hung rank); past it that decoder exits and is "
     "restarted with all its ranks"),
    ("--speculative-config", speculative_config,
     "speculative decoding on every decoder and prefill worker, as vLLM's JSON: n-gram lookup '{\"method\": "
     "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', a draft model '{\"model\": DIR, "
     "\"num_speculative_tokens\": 4}' or EAGLE-3 heads '{\"method\": \"eagle3\", \"model\": DIR, ...}'; checked "
     "here as the decoder checks it (a bad one exits 2 before anything starts), then passed as given"),
    ("--max-seqs-per-request", non_negative,
     "rows one request's n choices hold at once on a decoder; the rest wait for its own rows (0: --max-num-seqs // 2)"),
    ("--block-size", positive, "tokens per K/V block (the pool's unit; prefixes are reused in whole blocks)"),
    ("--gpu-memory-utilization", fraction, "CUDA: share of each decoder's GPU for weights, activations and K/V"),
    ("--kv-cache-memory", byte_size,
     "bytes of each decoder's K/V pool, e.g. 4GiB (0: from --gpu-memory-utilization on CUDA, a quarter of RAM on CPU)"),
    ("--max-num-batched-tokens", non_negative,
     "tokens one decoder step runs, prefill chunks and decode rows together (0: max(2048, --max-num-seqs))"),
    ("--max-prefill-tokens", non_negative,
     "prompt tokens a decoder prefills per step while others decode (0: no cap of its own, the step's "
     "--max-num-batched-tokens, as vLLM's chunked prefill)"),
    ("--prefix-cache-bytes", non_negative,
     "bytes of prompt-prefix K/V each decoder keeps for reuse (0 turns prefix caching off)"),
    ("--grammar-compile-threads", positive, "threads each decoder compiles response_format and tool grammars on"),
    ("--grammar-compile-timeout", positive_seconds, "seconds one grammar compile may run on a decoder"),
    ("--handoff-min-tokens", non_negative,
     "with --num-prefills: prompts with fewer tokens to prefill are not handed off (the decoders prefill them)"),
    ("--max-loras", positive, "LoRA adapters resident on each decoder at once (least recently used evicted)"),
    ("--max-lora-rank", positive, "the largest LoRA rank a decoder accepts (vLLM's choices: 1, 8, 16, ... 512)"),
    ("--max-cpu-loras", non_negative, "LoRA adapters each decoder keeps in host memory, resident or not (0: --max-loras)"),
    ("--allowed-lora-dir", str, "the folder runtime LoRA loads may read adapters from (unset: runtime loads refused)"),
    ("--default-mm-loras", default_mm_loras,
     "vLLM's JSON {modality: adapter folder} each decoder applies to requests naming no adapter (default: the "
     "checkpoint's own, Phi-4-multimodal's speech-lora and vision-lora; '{}': none)"),
    ("--quantization", choice(QUANTIZATION_CHOICES), QUANTIZATION_HELP),
    ("--quantized-weights", choice(QUANTIZED_WEIGHTS_CHOICES), QUANTIZED_WEIGHTS_HELP),
)
# passed to every spawned encoder and decoder only when given (spawn.py)
WORKER_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("--dtype", choice(DTYPE_CHOICES), "weights' dtype of every worker (a quantized checkpoint's unquantized parts "
                                       "and what its weights dequantize to); auto: the checkpoint's"),
)
# the encoders' scheduler flags, passed to each spawned encoder only when given (spawn.py)
ENCODER_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("--max-encode-batch-items", positive, "items per vision forward of an encoder, from any requests"),
    ("--max-encode-batch-tokens", positive, "vision tokens per vision forward of an encoder"),
    ("--max-pending-encode-tokens", positive,
     "vision tokens waiting in an encoder; a call past it gets 503 encoder_busy and the proxy tries another encoder"),
    ("--max-ungathered-bytes", positive_bytes,
     "bytes of embeddings an encoder stored that no decoder fetched yet; past it a call gets 503 encoder_busy"),
    ("--ec-disk-bytes", positive_bytes, "bytes of files each encoder's disk tier keeps (with --ec-disk-dir)"),
)
EC_DISK_DIR = "--ec-disk-dir"  # each spawned encoder gets its own subfolder, kept across its restarts (spawn.py)
DECODER_SWITCHES = (("--enforce-eager", "CUDA: decoders run every step eagerly, no CUDA graphs"),
                    ("--cpu-exact-linear", "CPU: decoders run every linear through torch's F.linear, bit-equal with "
                                           "transformers (default: oneDNN's prepacked weights, the MLP's SiLU fused in: faster)"),
                    ("--cpu-sdpa-attention", "CPU: decoders gather K/V blocks for torch's SDPA (default: a C++ "
                                             "kernel reads them in place)"),
                    ("--cpu-packed-linear", "accepted so old command lines work: prepacked linears are the CPU default"),
                    ("--enable-lora", "decoders serve LoRA adapters (--lora-modules); a request selects one by `model`"),
                    ("--enable-lora-runtime-updating", "POST /v1/load_lora_adapter and /v1/unload_lora_adapter on the "
                                                       "proxy load and unload adapters on every decoder"))
LORA_MODULES = "--lora-modules"  # every decoder and prefill worker gets the same adapters (spawn.py)
LAUNCHER_FLAGS = ("--model", "--num-encoders", "--num-decoders", "--num-prefills", "--worker-host",
                  "--worker-base-port",
                  "--max-restarts",
                  "--restart-window", "--restart-backoff", "--restart-backoff-max",
                  *(spec[0] for spec in DECODER_FLAGS), *(flag for flag, _ in DECODER_SWITCHES),
                  *(spec[0] for spec in ENCODER_FLAGS), *(spec[0] for spec in WORKER_FLAGS), EC_DISK_DIR, LORA_MODULES,
                  *AUTOSCALE_FLAGS)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse; `args.attach` says the mode. Launcher and attach flags mixed exit 2 naming both."""
    p = build_parser()
    mode_dests = [_dest(f) for f in (*LAUNCHER_FLAGS, *ATTACH_FLAGS)]
    args = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(mode_dests, _UNSET)))
    launcher = [f for f in LAUNCHER_FLAGS if getattr(args, _dest(f)) is not _UNSET]
    attach = [f for f in ATTACH_FLAGS if getattr(args, _dest(f)) is not _UNSET]
    if launcher and attach:
        p.error(f"launcher-mode flags ({', '.join(launcher)}) and attach-mode flags ({', '.join(attach)}) on one "
                "command line: launcher mode spawns its own workers, attach mode uses workers started elsewhere; "
                "use the flags of one mode")
    for dest in mode_dests:
        if getattr(args, dest) is _UNSET:
            setattr(args, dest, p.get_default(dest))
    args.attach = bool(attach)
    if args.proxy_workers > 1 and args.dynamic_registration:
        p.error("--proxy-workers > 1 and --dynamic-registration on one command line: each proxy process keeps its "
                "own worker list, so a POST/DELETE /instances would reach one process and the lists would diverge; "
                "use --proxy-workers 1, or fixed --encode-servers-urls / --decode-servers-urls")
    check_autoscale(p, args)
    return p, args


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("disagg-epd-proxy", "The EPD proxy (OpenAI-compatible API). Launcher mode (no worker URLs) "
                                       "spawns encoders and decoders here; attach mode uses workers started "
                                       "elsewhere (--encode-servers-urls / --decode-servers-urls).")
    _common_flags(p)
    _launcher_flags(p.add_argument_group("launcher mode (spawns the workers on this machine)"))
    _decoder_flags(p.add_argument_group("launcher mode: decoder engine (passed to each spawned decoder as its own "
                                        "flag; unset: the decoder's default)"))
    g = p.add_argument_group("launcher mode: encoders (passed to each spawned encoder; unset: its default)")
    for flag, kind, text in ENCODER_FLAGS:
        g.add_argument(flag, type=kind, default=None, help=f"{text} (default: the encoder's own)")
    g.add_argument(EC_DISK_DIR, default=None,
                   help="folder for the encoders' disk tiers: encoder i writes DIR/encoder-i and, restarted, serves "
                        "repeats from it without encoding them again (default: memory only)")
    add_autoscale_flags(p.add_argument_group("launcher mode: --autoscale (epd-planner's rule, on the local fleet)"))
    _attach_flags(p.add_argument_group("attach mode (workers started elsewhere)"))
    add_http_flags(p, ProxyConfig)
    add_tracing_flags(p)  # launcher mode: passed on to every spawned worker
    return p


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: launcher: --model's name; attach: the name of the "
                        "model the workers report)")
    p.add_argument("--host", default="127.0.0.1", help="address the API listens on")
    p.add_argument("--port", type=int, default=8000, help="port the API listens on")
    p.add_argument("--proxy-workers", type=proxy_workers, default=1,
                   help="proxy processes serving the port (SO_REUSEPORT: the kernel spreads connections over them), "
                        "for a proxy that needs more than one core; each has its own worker health view and cache "
                        "index, and a scrape of /metrics on any of them answers the counters and histograms of all "
                        "added up (the fleet gauges are the answering process's view); refused with dynamic "
                        "registration (/instances)")
    add_log_level(p, "info")
    p.add_argument("--aggregated", action="store_true",
                   help="no encoders: decoders load the vision tower too and encode images sent inline "
                        "(launcher: spawns --num-decoders aggregated decoders; the baseline EPD is compared with)")
    p.add_argument("--pipeline-encode", action="store_true",
                   help="send the decode request as soon as encodes are scheduled; the decoder's gather waits for "
                        "the embeddings (see docs/BENCHMARKS.md for the TTFT it saves)")
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds for one encode or generation")
    p.add_argument("--encoder-busy-timeout", type=positive_seconds, default=30.0,
                   help="seconds an encode may wait while every encoder answers busy (503 encoder_busy: each try goes "
                        "to another encoder first, then waits its Retry-After); then 503 encoders_saturated")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for workers to be healthy")
    p.add_argument("--api-key", default=cli_secret("EPD_API_KEY"),
                   help="clients must send `Authorization: Bearer <key>` on /v1/* (default: env EPD_API_KEY, or the "
                        "file EPD_API_KEY_FILE names; unset: open)")
    p.add_argument("--internal-key", default=cli_secret("EPD_INTERNAL_KEY"),
                   help="Bearer key of the internal side: sent to workers (start them with the same --internal-key) "
                        "and required on /instances (default: env EPD_INTERNAL_KEY, or the file "
                        "EPD_INTERNAL_KEY_FILE names; unset: attach mode needs --insecure, launcher mode makes one per "
                        "start)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health probes of a worker")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds one probe may take")
    p.add_argument("--health-failures", type=int, default=3,
                   help="failed probes in a row that take a worker out (a failed call takes it out at once)")
    _affinity_flags(p.add_argument_group("prefix affinity (routing conversations to the decoder holding their "
                                          "prefix)"))
    add_image_flags(p.add_argument_group("images"))
    add_video_flags(p.add_argument_group("videos (video_url parts; URLs are loaded under the image flags' rules)"))
    add_audio_flags(p.add_argument_group("audio (input_audio and audio_url parts; URLs are loaded under the image "
                                      "flags' rules)"))


def _affinity_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--no-prefix-affinity", dest="prefix_affinity", action="store_false",
                   help="choose decoders by load alone (default: a request goes to the decoder that holds the longest "
                        "prefix of its conversation, within --affinity-load-gap of the least-loaded one)")
    g.add_argument("--affinity-load-gap", type=non_negative, default=4,
                   help="generations in flight a decoder holding a request's prefix may have beyond the least-loaded "
                        "decoder and still get it; past that the request goes where there is room (0: affinity "
                        "only breaks ties of load)")


def _launcher_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--model", default="demo", help="'demo', a built-in bench model ('bench', 'bench-lm', "
                   "'bench-video'), a checkpoint directory, or a hub id")
    g.add_argument("--num-encoders", type=int, default=1, help="encoder processes to spawn")
    g.add_argument("--num-decoders", type=int, default=1, help="decoder processes to spawn")
    g.add_argument("--num-prefills", type=int, default=0,
                   help="prefill workers to spawn (E -> P -> D: each request prefills on one, then decodes on a "
                        "decoder, which runs --role decode); 0: the decoders prefill (E + PD)")
    g.add_argument("--worker-host", default="127.0.0.1", help="address the spawned workers bind")
    g.add_argument("--worker-base-port", type=base_port, default=0,
                   help="HTTP ports of the spawned workers, the same at every start: encoder i at this + i, then the "
                        "decoders, then the prefill workers (what Prometheus scrapes); 0: fresh ports")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one worker within --restart-window; past that it is left down")
    g.add_argument("--restart-window", type=float, default=600.0, help="seconds over which restarts are counted")
    g.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart of a worker that exited; doubles per restart in the window")
    g.add_argument("--restart-backoff-max", type=float, default=30.0, help="longest wait before a restart (seconds)")


def _decoder_flags(g: argparse._ActionsContainer) -> None:
    """The decoder's engine flags, for every spawned decoder (as `vllm serve` takes engine arguments)."""
    for flag, kind, text in DECODER_FLAGS:
        g.add_argument(flag, type=kind, default=None, help=f"{text} (default: the decoder's own)")
    for flag, kind, text in WORKER_FLAGS:
        g.add_argument(flag, type=kind, default=None, help=f"{text} (default: the workers' own)")
    for flag, text in DECODER_SWITCHES:
        g.add_argument(flag, action="store_true", default=None, help=f"{text} (default: off)")
    g.add_argument(LORA_MODULES, nargs="+", type=lora_module, default=None,
                   help="LoRA adapters every decoder serves, as vLLM's flag: name=path or JSON {\"name\", \"path\", "
                        "\"base_model_name\"}; needs --enable-lora")


def _attach_flags(g: argparse._ActionsContainer) -> None:
    g.add_argument("--encode-servers-urls", nargs="+", help="encoder base URLs (space- or comma-separated)")
    g.add_argument("--decode-servers-urls", nargs="+", help="decoder base URLs (space- or comma-separated)")
    g.add_argument("--prefill-servers-urls", nargs="*", type=prefill_url, default=["disable"],
                   help="prefill workers' base URLs (epd-decoder --role prefill; space- or comma-separated): each "
                        "request prefills there and continues on a decoder (E -> P -> D); vLLM's disable, none or "
                        "\"\" (the default): the decoders prefill (E + PD)")
    g.add_argument("--dynamic-registration", action="store_true",
                   help="workers may also be added/removed at run time with POST/DELETE /instances (the URL lists "
                        "may then be empty); needs --internal-key")
    g.add_argument("--insecure", action="store_true", default=env_flag("EPD_INSECURE"),
                   help="run without --internal-key and CURVE keys (logs a WARNING naming what is open) (default: "
                        "env EPD_INSECURE=1, else off)")
    add_curve_flags(g, allowed_clients=False)
