"""The `epd-decoder` command line: flags -> config -> the worker's HTTP server."""
from __future__ import annotations

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app
from epd_common.cli import parse_config, run_worker, worker_parser


def parse_args(argv: list[str] | None = None) -> DecoderConfig:
    d = DecoderConfig()
    p = worker_parser("epd-decoder", "EPD decoder worker (language model only)", d)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="requests waiting for a slot; more get 503")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences decoded together; a KV slot of --max-model-len is preallocated for each")
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens prefilled per engine step while streams decode (8x when none do)")
    p.add_argument("--gather-timeout", type=float, default=d.gather_timeout)
    p.add_argument("--aggregated", action="store_true",
                   help="also load the vision tower and encode images sent inline (one process, no encoders)")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, help="aggregated mode")
    p.add_argument("--engine-stall-timeout", type=float, default=d.engine_stall_timeout,
                   help="seconds the engine loop may make no progress; then /health answers 503 and the process "
                        "exits with status 70")
    p.add_argument("--ec-cache-bytes", type=int, default=d.ec_cache_bytes,
                   help="bytes of gathered embeddings this decoder keeps (LRU)")
    g = p.add_argument_group("connector limits (ZeroMQ consumer)")
    g.add_argument("--ec-max-reply-bytes", type=int, default=d.ec_max_reply_bytes,
                   help="tensor bytes of one reply from an encoder; a larger reply is refused before it is decoded")
    g.add_argument("--ec-max-message-bytes", type=int, default=d.ec_max_message_bytes,
                   help="bytes of one tensor frame; an encoder sending a larger one is disconnected")
    g.add_argument("--ec-max-items-per-get", type=int, default=d.ec_max_items_per_get,
                   help="hashes asked of one encoder per get (keep at most the encoders' --ec-max-items-per-get)")
    return parse_config(p, argv, DecoderConfig)


def main(argv: list[str] | None = None) -> None:
    run_worker("decoder", parse_args(argv), create_app)


if __name__ == "__main__":
    main()
