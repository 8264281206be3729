"""disagg-epd-proxy argument handling."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.control.security import load_curve_config
from epd_common.server import ENV_REUSE_PORT
from epd_launcher import cli, spawn
from epd_launcher.cli import _config, _urls, main
from epd_launcher.flags import DECODER_FLAGS, DECODER_SWITCHES, build_parser, parse_args
from epd_launcher.group import RestartPolicy, Secrets, Worker, WorkerGroup
from proxy.config import ProxyConfig
from proxy.workers import served_name
from tests.ports import PortHolds


@pytest.fixture(autouse=True)
def keep_root_logging() -> Iterator[None]:
    """main() installs the service's log handler on the root logger; put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_worker_urls_accept_spaces_and_commas() -> None:
    assert _urls(["http://a:1,http://b:2/", "http://c:3"]) == ("http://a:1", "http://b:2", "http://c:3")


def test_attach_mode_needs_both_kinds_of_worker(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--encode-servers-urls", "http://e:1"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("disagg-epd-proxy: error: attach mode needs both")


def test_flags_map_to_the_proxy_config() -> None:
    _, args = parse_args(["--model", "/models/Qwen2-VL-2B/", "--max-images-per-request", "3",
                          "--max-image-pixels", "1000", "--port", "9000"])
    cfg = _config(args, ("http://e",), ("http://d",), None, served_name(args.model))
    assert (cfg.served_model_name, cfg.max_images_per_request, cfg.max_image_pixels, cfg.port) == (
        "Qwen2-VL-2B", 3, 1000, 9000)


def test_curve_keys_load_from_files_into_the_config(tmp_path: Path) -> None:
    from connector.control.curve_flags import pop_curve
    from connector.control.security import generate_keypair

    enc_public, _ = generate_keypair(tmp_path, "encoders")
    _, proxy_secret = generate_keypair(tmp_path, "proxy")
    flags = ["--ec-curve-key", str(proxy_secret), "--ec-curve-server-key", str(enc_public)]
    parser = build_parser()
    args = parser.parse_args(["--pipeline-encode", *flags])
    cfg = _config(args, ("http://e",), ("http://d",), pop_curve(parser, args), None)
    assert cfg.pipeline_encode and cfg.curve is not None and cfg.curve.server_key is not None


def test_a_missing_key_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--ec-curve-key", "/nonexistent/key_secret", "--encode-servers-urls", "http://e", "--decode-servers-urls",
              "http://d"])
    assert "/nonexistent/key_secret" in capsys.readouterr().err


ATTACH = ["--encode-servers-urls", "http://127.0.0.1:1", "--decode-servers-urls", "http://127.0.0.1:2"]


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[ProxyConfig]:
    """main() builds the app but serves nothing: the configs it would have served are collected."""
    configs: list[ProxyConfig] = []
    monkeypatch.setattr(cli, "create_app", lambda cfg, **_: cfg)
    monkeypatch.setattr(cli, "serve", lambda cfg, *a, **k: configs.append(cfg))
    monkeypatch.delenv("EPD_INTERNAL_KEY", raising=False)
    monkeypatch.delenv("EPD_INSECURE", raising=False)
    return configs


@pytest.fixture
def held(port_holds: PortHolds, monkeypatch: pytest.MonkeyPatch) -> int:
    """A port held for the test; main() checks it beside the hold, as a proxy started on it would bind it."""
    monkeypatch.setenv(ENV_REUSE_PORT, "1")
    return port_holds.take()


@pytest.mark.parametrize("url,why", [
    ("127.0.0.1:8001", "needs a scheme"), ("localhost", "needs a scheme"), ("http://h:99999", "bad port"),
    ("http://h:port", "bad port"), ("http://h:1/v1", "base URL"), ("ftp://h:1", "needs a scheme"),
    ("http://:1", "no host"),
])
def test_a_malformed_worker_url_is_a_usage_error_at_once(url: str, why: str, served: list[ProxyConfig],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--insecure", "--encode-servers-urls", url, "--decode-servers-urls", "http://127.0.0.1:2"])
    assert exc.value.code == 2 and why in capsys.readouterr().err and not served


def test_attach_mode_refuses_to_start_open_and_names_what_is_missing(served: list[ProxyConfig],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(ATTACH)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--internal-key" in err and "CURVE" in err and "--insecure" in err
    assert not served


@pytest.mark.parametrize("how", ["flag", "env"])
def test_insecure_attach_mode_starts_and_warns_what_is_open(how: str, served: list[ProxyConfig], held: int,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    if how == "env":
        monkeypatch.setenv("EPD_INSECURE", "1")
    main([*ATTACH, *(["--insecure"] if how == "flag" else []), "--port", str(held)])
    assert len(served) == 1 and served[0].internal_key is None
    warning = capsys.readouterr().err  # main() logs to stderr through the service's own handler
    assert "WARNING" in warning and "INSECURE" in warning and "--internal-key" in warning and "CURVE" in warning


def test_attach_mode_with_both_credentials_needs_no_waiver(served: list[ProxyConfig], held: int,
                                                           tmp_path: Path) -> None:
    from connector.control.security import generate_keypair

    enc_public, _ = generate_keypair(tmp_path, "encoders")
    _, proxy_secret = generate_keypair(tmp_path, "proxy")
    main([*ATTACH, "--internal-key", "k", "--ec-curve-key", str(proxy_secret), "--ec-curve-server-key",
          str(enc_public), "--port", str(held)])
    assert served[0].internal_key == "k" and served[0].curve is not None


@pytest.mark.parametrize("mode", ["attach", "launcher"])
def test_a_port_in_use_fails_before_any_worker_is_spawned_or_waited_for(
        mode: str, served: list[ProxyConfig], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_launch(*args: object) -> None:
        raise AssertionError("workers were spawned")

    monkeypatch.setattr(spawn, "start_workers", no_launch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        with pytest.raises(SystemExit) as exc:
            main([*([*ATTACH, "--insecure"] if mode == "attach" else []), "--port", port])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"disagg-epd-proxy: error: cannot listen on 127.0.0.1:{port}" in err and not served


def test_launcher_keys_go_to_each_role_through_the_environment() -> None:
    keys = Secrets.generate()
    enc, dec, curve = keys.env("encoder"), keys.env("decoder"), keys.proxy_curve()
    assert enc["EPD_INTERNAL_KEY"] == dec["EPD_INTERNAL_KEY"] == keys.internal_key and len(keys.internal_key) >= 32
    encoder = load_curve_config(None, env=enc)
    decoder = load_curve_config(None, env=dec)
    assert encoder is not None and decoder is not None
    assert encoder.allowed_clients == frozenset({decoder.public_key}) == frozenset({curve.public_key})
    assert decoder.server_key == curve.server_key == encoder.public_key and decoder.secret_key != encoder.secret_key
    assert keys.internal_key not in repr(keys) and encoder.secret_key.decode() not in repr(keys)
    assert Secrets.generate().internal_key != keys.internal_key  # per start


def exits(code: int) -> list[str]:
    return [sys.executable, "-c", f"raise SystemExit({code})"]


def exited_worker(code: int = 3) -> Worker:
    proc = subprocess.Popen(exits(code))
    proc.wait()
    return Worker("decoder", "http://127.0.0.1:1", proc, cmd=exits(code), env=dict(os.environ))


def test_an_exited_worker_is_restarted_with_doubling_backoff_then_left_down_past_the_cap(
        caplog: pytest.LogCaptureFixture) -> None:
    group = WorkerGroup(policy=RestartPolicy(max_restarts=3, window=100.0, backoff=1.0, backoff_max=3.0))
    w = exited_worker()
    now, delays = 0.0, []
    while not w.given_up:
        group.check(w, now)  # notices the exit: schedules a restart
        if w.given_up:
            break
        assert w.restart_at is not None
        delays.append(w.restart_at - now)
        group.check(w, w.restart_at - 0.01)
        assert w.restart_at is not None  # not yet
        now = w.restart_at
        first = w.proc
        group.check(w, now)
        assert w.proc is not first and w.restart_at is None  # restarted: same command, new process
        w.proc.wait()
    assert delays == [1.0, 2.0, 3.0] and len(w.restarts) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("exited with code 3" in m for m in messages) == 4
    assert any("not restarting" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_restarts_older_than_the_window_no_longer_count() -> None:
    group = WorkerGroup(policy=RestartPolicy(max_restarts=1, window=10.0, backoff=1.0, backoff_max=1.0))
    w = exited_worker()
    w.restarts.append(0.0)
    group.check(w, 5.0)
    assert w.given_up  # one restart 5 s ago: the cap is reached
    w = exited_worker()
    w.restarts.append(0.0)
    group.check(w, 11.0)
    assert not w.given_up and w.restart_at == 12.0 and not w.restarts


def test_a_stopped_group_restarts_nothing() -> None:
    group = WorkerGroup()
    w = exited_worker()
    group.workers.append(w)
    group.stop()
    group.check(w, 0.0)
    assert w.restart_at is None and w.proc.returncode == 3


class RecordingGroup:
    """Records what spawn_workers would start."""

    def __init__(self) -> None:
        self.spawned: list[tuple[str, list[str]]] = []
        self.ports: list[int] = []  # each worker's asked port (0: a fresh one)
        self.envs: list[dict[str, str]] = []  # each worker's extra environment (keys, CUDA_VISIBLE_DEVICES)

    def spawn(self, role: str, model: str, host: str, threads: int, extra: list[str],
              env: dict[str, str] | None = None, port: int = 0) -> Worker:
        self.spawned.append((role, extra))
        self.ports.append(port)
        self.envs.append(dict(env or {}))
        return type("Spawned", (), {"url": f"http://{host}:{len(self.spawned)}"})()

    def wait_healthy(self, timeout: float) -> None:
        pass


@pytest.mark.parametrize("given", [None, "0", "1048576"])
def test_prefix_cache_bytes_goes_to_the_spawned_decoders_only_when_given(given: str | None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args
    from decoder_service.config import DecoderConfig

    monkeypatch.setenv("EPD_INSECURE", "1")
    _, args = parse_args(["--num-decoders", "2", *(["--prefix-cache-bytes", given] if given else [])])
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    decoders = [extra for role, extra in group.spawned if role == "decoder"]
    encoders = [extra for role, extra in group.spawned if role == "encoder"]
    assert len(decoders) == 2 and all("--prefix-cache-bytes" not in extra for extra in encoders)
    expected = DecoderConfig().prefix_cache_bytes if given is None else int(given)
    for extra in decoders:
        assert ("--prefix-cache-bytes" in extra) == (given is not None)
        assert decoder_args([a for a in extra if a != "--device" and not a.startswith("cuda:")]) \
            .prefix_cache_bytes == expected


ENGINE_ARGV = ["--max-model-len", "8192", "--max-num-seqs", "256", "--block-size", "32", "--gpu-memory-utilization",
               "0.8", "--kv-cache-memory", "4GiB", "--max-num-batched-tokens", "4096", "--enforce-eager",
               "--max-prefill-tokens", "64", "--grammar-compile-threads", "3", "--grammar-compile-timeout", "2.5",
               "--tensor-parallel-size", "2", "--cpu-exact-linear"]
ENGINE_FLAGS = [a for a in ENGINE_ARGV if a.startswith("--")]
ENGINE_FIELDS = {"max_model_len": 8192, "max_num_seqs": 256, "block_size": 32, "gpu_memory_utilization": 0.8,
                 "kv_cache_memory": 4 << 30, "max_num_batched_tokens": 4096, "enforce_eager": True,
                 "max_prefill_tokens": 64, "grammar_compile_threads": 3, "grammar_compile_timeout": 2.5,
                 "tensor_parallel_size": 2, "cpu_exact_linear": True}


def spawned_workers(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                    gpus: int | None = None) -> list[tuple[str, list[str]]]:
    """(role, extra arguments) of each worker `disagg-epd-proxy argv` would spawn (nothing is started); `gpus`: as
    if this machine had that many (None: the GPUs it has)."""
    monkeypatch.setenv("EPD_INSECURE", "1")
    if gpus is not None:
        monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    _, args = parse_args(argv)
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    return list(group.spawned)


def spawned_decoders(monkeypatch: pytest.MonkeyPatch, argv: list[str], gpus: int | None = None) -> list[list[str]]:
    """The extra arguments of each decoder `disagg-epd-proxy argv` would spawn (device flags left out)."""
    workers = spawned_workers(monkeypatch, argv, gpus)
    assert not [a for role, extra in workers if role == "encoder" for a in extra if a in ENGINE_FLAGS]
    return [[a for a in extra if a != "--device" and not a.startswith("cuda:")]
            for role, extra in workers if role == "decoder"]


def test_the_decoders_engine_flags_reach_every_spawned_decoder_as_vllm_serve_takes_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args

    # the prefill workers too (each is an epd-decoder); no GPU here: --tensor-parallel-size 2 needs 6 of them
    decoders = spawned_decoders(monkeypatch, ["--num-decoders", "2", "--num-prefills", "1", *ENGINE_ARGV], gpus=0)
    assert len(decoders) == 3 and sum("prefill" in extra for extra in decoders) == 1
    for extra in decoders:
        cfg = decoder_args(extra)
        assert {name: getattr(cfg, name) for name in ENGINE_FIELDS} == ENGINE_FIELDS


def test_engine_flags_not_given_leave_each_decoder_its_own_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args
    from decoder_service.config import DecoderConfig

    (extra,) = spawned_decoders(monkeypatch, ["--model", "demo"])
    assert not [a for a in extra if a in ENGINE_FLAGS]
    cfg, default = decoder_args(extra), DecoderConfig()
    assert all(getattr(cfg, name) == getattr(default, name) for name in ENGINE_FIELDS)
    (extra,) = spawned_decoders(monkeypatch, ["--kv-cache-memory", "1.5 GiB"])  # one flag: that flag alone
    engine = {spec[0] for spec in DECODER_FLAGS} | {flag for flag, _ in DECODER_SWITCHES}
    assert [a for a in extra if a in engine] == ["--kv-cache-memory"]
    assert decoder_args(extra).kv_cache_memory == 3 << 29


@pytest.mark.parametrize("argv,why", [(["--gpu-memory-utilization", "0"], "must be in (0, 1]"),
                                      (["--kv-cache-memory", "lots"], "not a byte size"),
                                      (["--max-num-seqs", "0"], "must be >= 1"),
                                      (["--max-model-len", "8192", *ATTACH], "attach-mode flags")])
def test_bad_or_attach_mode_engine_flags_are_usage_errors(argv: list[str], why: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err


def test_video_flags_map_to_the_proxy_config_with_its_defaults() -> None:
    _, args = parse_args([])
    cfg = _config(args, ("http://e",), ("http://d",), None, None)
    default = ProxyConfig(encode_urls=("http://e",), decode_urls=("http://d",))
    names = ("max_videos_per_request", "max_video_bytes", "max_video_duration", "max_video_frames",
             "max_video_frame_pixels", "video_chunk_frames", "max_video_fanout_bytes")
    assert [getattr(cfg, n) for n in names] == [getattr(default, n) for n in names] == \
        [4, 64 << 20, 600.0, 256, 1920 * 1080 * 2, 16, 256 << 20]
    _, args = parse_args(["--max-videos-per-request", "0", "--max-video-bytes", "1000", "--max-video-duration", "2.5",
                          "--max-video-frames", "8", "--max-video-frame-pixels", "640", "--video-chunk-frames", "4",
                          "--max-video-fanout-bytes", "5000"])
    cfg = _config(args, ("http://e",), ("http://d",), None, None)
    assert [getattr(cfg, n) for n in names] == [0, 1000, 2.5, 8, 640, 4, 5000]


@pytest.mark.parametrize("flag,value", [("--max-video-frames", "0"), ("--max-video-frames", "4097"),
                                        ("--max-video-duration", "0"), ("--max-video-duration", "inf"),
                                        ("--video-chunk-frames", "0"), ("--max-video-bytes", "-1"),
                                        ("--max-videos-per-request", "-1")])
def test_out_of_range_video_flags_are_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args([flag, value])
    assert exc.value.code == 2 and f"argument {flag}: " in capsys.readouterr().err


def test_spawned_encoders_get_the_proxys_video_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder probes each video again: with the proxy's limits it refuses none the proxy took."""
    from encoder_service.cli import parse_args as encoder_args

    encoders = [extra for role, extra in spawned_workers(monkeypatch, [
        "--num-encoders", "2", "--max-video-duration", "1200", "--max-video-frames", "1000",
        "--max-video-frame-pixels", "12345"]) if role == "encoder"]
    assert len(encoders) == 2
    for extra in encoders:
        cfg = encoder_args(["--model", "demo", *[a for a in extra if a != "--device" and not a.startswith("cuda:")]])
        assert (cfg.max_video_duration, cfg.max_video_frames, cfg.max_video_frame_pixels) == (1200.0, 1000, 12345)


def test_spawned_aggregated_decoders_get_the_proxys_video_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aggregated decoder samples and encodes each video itself: the proxy's limits go to it too."""
    from decoder_service.cli import parse_args as decoder_args

    monkeypatch.setenv("EPD_INSECURE", "1")
    _, args = parse_args(["--aggregated", "--num-decoders", "2", "--max-video-duration", "1200",
                          "--max-video-frames", "1000", "--max-video-frame-pixels", "12345"])
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    decoders = [extra for role, extra in group.spawned if role == "decoder"]
    assert len(decoders) == 2 and not [role for role, _ in group.spawned if role == "encoder"]
    for extra in decoders:
        cfg = decoder_args(["--model", "demo", *[a for a in extra if a != "--device" and not a.startswith("cuda:")]])
        assert (cfg.max_video_duration, cfg.max_video_frames, cfg.max_video_frame_pixels) == (1200.0, 1000, 12345)
    _, args = parse_args(["--num-decoders", "1"])  # EPD mode: the decoders never see a video file
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    assert not [a for role, extra in group.spawned if role == "decoder" for a in extra if a.startswith("--max-video")]


@pytest.mark.parametrize("base", [0, 9100])
def test_worker_base_port_numbers_encoders_then_decoders_then_prefill_workers(
        base: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_INSECURE", "1")
    _, args = parse_args(["--model", "demo", "--num-encoders", "2", "--num-decoders", "1", "--num-prefills", "1",
                          "--worker-base-port", str(base)])
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    kinds = [("prefill" if "prefill" in extra else role) for role, extra in group.spawned]
    assert kinds == ["encoder", "encoder", "decoder", "prefill"]
    assert group.ports == ([base, base + 1, base + 2, base + 3] if base else [0, 0, 0, 0])


def test_quantization_goes_to_the_decoders_and_dtype_to_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's --quantization and --dtype: the launcher passes the first to each decoder (whose own check compares
    it with the checkpoint) and --dtype to encoders and decoders alike (what a quantized checkpoint leaves
    unquantized, on both halves); not given, neither is passed."""
    from decoder_service.cli import parse_args as decoder_args
    from encoder_service.cli import parse_args as encoder_args

    argv = ["--num-decoders", "2", "--quantization", "awq", "--quantized-weights", "dequantize", "--dtype", "bfloat16"]
    workers = spawned_workers(monkeypatch, argv)
    local = lambda extra: [a for a in extra if a != "--device" and not a.startswith("cuda:")]  # noqa: E731
    decoders = [decoder_args(local(extra)) for role, extra in workers if role == "decoder"]
    encoders = [encoder_args(local(extra)) for role, extra in workers if role == "encoder"]
    assert len(decoders) == 2 and encoders
    assert {(d.quantization, d.quantized_weights, d.dtype) for d in decoders} == {("awq", "dequantize", "bfloat16")}
    assert {e.dtype for e in encoders} == {"bfloat16"}
    plain = spawned_workers(monkeypatch, ["--num-decoders", "1"])
    assert not [a for _, extra in plain for a in extra if a in ("--quantization", "--quantized-weights", "--dtype")]
