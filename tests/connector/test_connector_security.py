"""CURVE encryption and client allow-lists on raw ROUTER/DEALER sockets over TCP loopback."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from connector.control.security import (
    ENV_ALLOWED_CLIENTS,
    ENV_FILES,
    ENV_SECRET_KEY,
    ENV_SERVER_KEY,
    SECRET_FILES,
    CurveConfig,
    generate_keypair,
    load_curve_config,
    main,
    secure_client,
    secure_server,
    start_authenticator,
)
from epd_common.cli import MAX_SECRET_FILE_BYTES, env_secret

GUARD_MS = 5000  # upper bound for things that must happen; never reached when things work
SILENCE_MS = 1500  # bounded window in which a rejected message must not show up
FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH}

Sockets = Callable[[int], zmq.Socket]


def keys() -> CurveConfig:
    public, secret = zmq.curve_keypair()
    return CurveConfig(secret_key=secret, public_key=public)


def client_of(server: CurveConfig, client: CurveConfig | None = None) -> CurveConfig:
    client = client or keys()
    return CurveConfig(client.secret_key, client.public_key, server_key=server.public_key)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A private context (one ZAP handler per context) whose sockets all close with linger 0."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def sockets(ctx: zmq.Context) -> Iterator[Sockets]:
    made: list[zmq.Socket] = []

    def make(kind: int) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


def serve(sockets: Sockets, cfg: CurveConfig | None) -> tuple[zmq.Socket, zmq.Socket, str]:
    """A CURVE ROUTER bound to a random loopback port, plus a monitor socket watching its handshakes."""
    router = sockets(zmq.ROUTER)
    secure_server(router, cfg)
    monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    monitor.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, monitor, f"tcp://127.0.0.1:{port}"


def send_from(sockets: Sockets, address: str, cfg: CurveConfig | None) -> zmq.Socket:
    dealer = sockets(zmq.DEALER)
    secure_client(dealer, cfg)
    dealer.connect(address)
    dealer.send(b"ping")
    return dealer


def next_handshake(monitor: zmq.Socket) -> Mapping[str, Any]:
    assert monitor.poll(GUARD_MS), "no handshake seen by the server"
    return recv_monitor_message(monitor)


def assert_round_trip(router: zmq.Socket, dealer: zmq.Socket) -> None:
    assert router.poll(GUARD_MS)
    identity, body = router.recv_multipart()
    assert body == b"ping"
    router.send_multipart([identity, b"pong"])
    assert dealer.poll(GUARD_MS)
    assert dealer.recv() == b"pong"


def assert_rejected(router: zmq.Socket, dealer: zmq.Socket, monitor: zmq.Socket, event: int) -> Mapping[str, Any]:
    """The server saw the handshake fail, then nothing reaches it and no reply comes back."""
    seen = next_handshake(monitor)
    assert seen["event"] == event
    assert router.poll(SILENCE_MS) == 0
    assert dealer.poll(0) == 0
    return seen


def test_matching_keys_round_trip(sockets: Sockets) -> None:
    server = keys()
    router, monitor, address = serve(sockets, server)
    dealer = send_from(sockets, address, client_of(server))
    assert next_handshake(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert_round_trip(router, dealer)
    assert dealer.getsockopt(zmq.MECHANISM) == zmq.CURVE


def test_wrong_server_key_gets_nothing(sockets: Sockets) -> None:
    router, monitor, address = serve(sockets, keys())
    dealer = send_from(sockets, address, client_of(keys()))
    assert_rejected(router, dealer, monitor, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


def test_plaintext_client_gets_nothing(sockets: Sockets) -> None:
    router, monitor, address = serve(sockets, keys())
    dealer = send_from(sockets, address, None)
    seen = assert_rejected(router, dealer, monitor, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    assert seen["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


def allow_only(ctx: zmq.Context, allowed: CurveConfig) -> tuple[CurveConfig, CurveConfig, ThreadAuthenticator]:
    """A server key pair whose config admits only `allowed`, and the running authenticator for it."""
    server = keys()
    cfg = CurveConfig(server.secret_key, server.public_key, allowed_clients=frozenset({allowed.public_key}))
    auth = start_authenticator(ctx, cfg)
    assert auth is not None
    return server, cfg, auth


def test_allow_list_admits_listed_client_only(ctx: zmq.Context, sockets: Sockets) -> None:
    allowed = keys()
    server, cfg, auth = allow_only(ctx, allowed)
    try:
        router, monitor, address = serve(sockets, cfg)
        dealer = send_from(sockets, address, client_of(server, allowed))
        assert next_handshake(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert_round_trip(router, dealer)
        stranger = send_from(sockets, address, client_of(server))
        seen = assert_rejected(router, stranger, monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        assert seen["value"] == 400  # ZAP status code
    finally:
        auth.stop()


def test_allow_list_fails_closed_when_authenticator_stops(ctx: zmq.Context, sockets: Sockets) -> None:
    allowed = keys()
    server, cfg, auth = allow_only(ctx, allowed)
    try:
        router, monitor, address = serve(sockets, cfg)
    finally:
        auth.stop()
    dealer = send_from(sockets, address, client_of(server, allowed))
    # ZAP_ENFORCE_DOMAIN: the handshake fails, or stalls on the closing ZAP socket; it never succeeds
    assert router.poll(SILENCE_MS) == 0
    assert dealer.poll(0) == 0
    while monitor.poll(0):
        assert recv_monitor_message(monitor)["event"] in FAILED


def test_allow_list_without_authenticator_is_refused(sockets: Sockets) -> None:
    server = keys()
    cfg = CurveConfig(server.secret_key, server.public_key, allowed_clients=frozenset({keys().public_key}))
    with pytest.raises(RuntimeError, match="start_authenticator"):
        secure_server(sockets(zmq.ROUTER), cfg)


def test_second_authenticator_on_a_context_is_refused(ctx: zmq.Context) -> None:
    server = keys()
    cfg = CurveConfig(server.secret_key, server.public_key, allowed_clients=frozenset({keys().public_key}))
    auth = start_authenticator(ctx, cfg)
    assert auth is not None
    try:
        with pytest.raises(RuntimeError, match="ZAP handler"):
            start_authenticator(ctx, cfg)
    finally:
        auth.stop()


def test_none_config_is_a_no_op(ctx: zmq.Context, sockets: Sockets) -> None:
    router, dealer = sockets(zmq.ROUTER), sockets(zmq.DEALER)
    secure_server(router, None)
    secure_client(dealer, None)
    assert router.getsockopt(zmq.MECHANISM) == dealer.getsockopt(zmq.MECHANISM) == zmq.NULL
    assert start_authenticator(ctx, None) is None
    assert start_authenticator(ctx, keys()) is None  # no allow-list: CURVE alone, no ZAP thread


def test_client_without_server_key_is_refused(sockets: Sockets) -> None:
    with pytest.raises(ValueError, match=ENV_SERVER_KEY):
        secure_client(sockets(zmq.DEALER), keys())


def test_load_from_generated_files(tmp_path: Path) -> None:
    server_pub, server_secret = generate_keypair(tmp_path / "server", "producer")
    client_pub, client_secret = generate_keypair(tmp_path / "clients", "decoder0")
    generate_keypair(tmp_path / "clients", "decoder1")
    producer = load_curve_config(str(server_secret), allowed_clients_dir=str(tmp_path / "clients"), env={})
    consumer = load_curve_config(str(client_secret), server_key_file=str(server_pub), env={})
    assert producer is not None and consumer is not None
    assert producer.public_key == consumer.server_key == zmq.auth.load_certificate(server_pub)[0]
    assert producer.allowed_clients is not None and len(producer.allowed_clients) == 2
    assert consumer.public_key == zmq.auth.load_certificate(client_pub)[0] in producer.allowed_clients
    assert producer.server_key is None and consumer.allowed_clients is None


def test_load_from_env() -> None:
    server, a, b = keys(), keys(), keys()
    env = {ENV_SECRET_KEY: server.secret_key.decode(),
           ENV_ALLOWED_CLIENTS: f" {a.public_key.decode()} ,{b.public_key.decode()},"}
    assert load_curve_config(None, env=env) == CurveConfig(server.secret_key, server.public_key,
                                                           allowed_clients=frozenset({a.public_key, b.public_key}))
    env = {ENV_SECRET_KEY: a.secret_key.decode(), ENV_SERVER_KEY: server.public_key.decode()}
    assert load_curve_config(None, env=env) == client_of(server, a)


def test_files_take_precedence_over_env(tmp_path: Path) -> None:
    _, secret_file = generate_keypair(tmp_path, "node")
    cfg = load_curve_config(str(secret_file), env={ENV_SECRET_KEY: keys().secret_key.decode()})
    assert cfg is not None and cfg.secret_key == zmq.auth.load_certificate(secret_file)[1]


def test_unconfigured_is_none() -> None:
    assert load_curve_config(None, env={}) is None
    assert load_curve_config(None, None, None, env={ENV_SECRET_KEY: "  "}) is None


@pytest.mark.parametrize("var", [ENV_SECRET_KEY, ENV_SERVER_KEY, ENV_ALLOWED_CLIENTS])
@pytest.mark.parametrize("bad", ["too-short", "x" * 39 + "~", "%" * 40])
def test_malformed_env_key_names_the_variable(var: str, bad: str) -> None:
    env = {ENV_SECRET_KEY: keys().secret_key.decode(), var: bad}
    with pytest.raises(ValueError, match=var):
        load_curve_config(None, env=env)


def test_malformed_key_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text('curve\n    public-key = "not-a-key"\n')
    with pytest.raises(ValueError, match="bad.key"):
        load_curve_config(None, server_key_file=str(bad), env={ENV_SECRET_KEY: keys().secret_key.decode()})


def test_mismatched_keypair_file_is_refused(tmp_path: Path) -> None:
    other = keys()
    path = tmp_path / "mixed.key_secret"
    path.write_text(f'curve\n    public-key = "{other.public_key.decode()}"\n'
                    f'    secret-key = "{keys().secret_key.decode()}"\n')
    path.chmod(0o600)
    with pytest.raises(ValueError, match="does not match"):
        load_curve_config(str(path), env={})


def test_missing_files_are_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.key_secret")
    with pytest.raises(ValueError, match="nope.key_secret"):
        load_curve_config(missing, env={})
    with pytest.raises(ValueError, match="no-clients"):
        load_curve_config(None, allowed_clients_dir=str(tmp_path / "no-clients"), env={})


def test_half_configured_is_refused() -> None:
    with pytest.raises(ValueError, match=ENV_SECRET_KEY):
        load_curve_config(None, env={ENV_SERVER_KEY: keys().public_key.decode()})


def test_public_cert_as_secret_is_refused(tmp_path: Path) -> None:
    public_file, _ = generate_keypair(tmp_path, "node")
    with pytest.raises(ValueError, match="no secret-key"):
        load_curve_config(str(public_file), env={})


def test_readable_secret_file_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, secret_file = generate_keypair(tmp_path, "node")
    secret_file.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="epd.connector.security"):
        assert load_curve_config(str(secret_file), env={}) is not None
    assert "chmod 600" in caplog.text and str(secret_file) in caplog.text


def test_cli_generates_loadable_keypair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path)]) == 0
    public_file, secret_file = (Path(line) for line in capsys.readouterr().out.splitlines())
    assert (public_file, secret_file) == (tmp_path / "ec.key", tmp_path / "ec.key_secret")
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(public_file) == (public, None)


def test_cli_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path), "--name", "node"]) == 0
    before = (tmp_path / "node.key_secret").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tmp_path), "--name", "node"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("epd-ec-keygen: error: ") and "refusing to overwrite" in err
    assert (tmp_path / "node.key_secret").read_bytes() == before


def _env_lines(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_cli_env_writes_a_fleets_keys_as_secret_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s").chmod(0o755)  # an existing directory open to others is refused, never changed
    with pytest.raises(SystemExit) as refused:
        main(["env", str(tmp_path / "s")])
    assert refused.value.code == 2 and "open to other users (mode 755)" in capsys.readouterr().err
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o755 and not any((tmp_path / "s").iterdir())
    (tmp_path / "s").chmod(0o700)
    assert main(["env", str(tmp_path / "s")]) == 0
    paths = {Path(line).name: Path(line) for line in capsys.readouterr().out.splitlines()}
    assert list(paths) == [*SECRET_FILES, *ENV_FILES]
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    assert {n: stat.S_IMODE(os.stat(p).st_mode) for n, p in paths.items()} == {
        **dict.fromkeys(SECRET_FILES, 0o644), **dict.fromkeys(ENV_FILES, 0o600)}
    # the files as compose mounts them: each role reads its keys through EPD_*_FILE
    encoder_env = {"EPD_EC_CURVE_SECRET_KEY_FILE": str(paths["encoders_secret_key"]),
                   "EPD_EC_CURVE_ALLOWED_CLIENTS_FILE": str(paths["clients_public_key"])}
    client_env = {"EPD_EC_CURVE_SECRET_KEY_FILE": str(paths["clients_secret_key"]),
                  "EPD_EC_CURVE_SERVER_KEY_FILE": str(paths["encoders_public_key"])}
    enc_cfg, cli_cfg = load_curve_config(None, env=encoder_env), load_curve_config(None, env=client_env)
    assert enc_cfg is not None and cli_cfg is not None
    assert enc_cfg.allowed_clients == frozenset({cli_cfg.public_key}) and cli_cfg.server_key == enc_cfg.public_key
    curve, keys = _env_lines(paths["k8s-curve.env"]), _env_lines(paths["k8s-keys.env"])
    assert curve == {name.replace("_", "-"): paths[name].read_text().strip() for name in SECRET_FILES[2:]}
    assert keys == {"internal-key": paths["internal_key"].read_text().strip(),
                    "api-key": paths["api_key"].read_text().strip()}
    assert len(set(keys.values())) == 2 and all(len(v) >= 40 for v in keys.values())
    before = paths["internal_key"].read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main(["env", str(tmp_path / "s")])
    assert exit_info.value.code == 2 and paths["internal_key"].read_bytes() == before


def test_a_key_is_read_from_the_variable_or_the_file_its_FILE_variable_names(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_text("  s3cret\n")
    assert env_secret("K", {"K": " v "}) == "v" and env_secret("K", {"K_FILE": str(key)}) == "s3cret"
    assert env_secret("K", {}) is None and env_secret("K", {"K": "", "K_FILE": ""}) is None
    big, binary = tmp_path / "big", tmp_path / "bin"
    big.write_bytes(b"a" * (MAX_SECRET_FILE_BYTES + 1))
    binary.write_bytes(b"\xff\xfe")
    for env, words in [({"K": "v", "K_FILE": str(key)}, "both K and K_FILE"),
                       ({"K_FILE": str(tmp_path / "missing")}, "K_FILE: cannot read"),
                       ({"K_FILE": str(tmp_path)}, "K_FILE: cannot read"),
                       ({"K_FILE": str(big)}, "not a key"), ({"K_FILE": str(binary)}, "not ASCII")]:
        with pytest.raises(ValueError, match=words):
            env_secret("K", env)
    with pytest.raises(ValueError, match="EPD_EC_CURVE_SECRET_KEY_FILE: cannot read"):  # CURVE reads keys the same way
        load_curve_config(None, env={"EPD_EC_CURVE_SECRET_KEY_FILE": str(tmp_path / "missing")})


def test_cli_help_says_when_keys_are_needed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "launcher" in out and "compose" in out and "Kubernetes" in out and "epd-ec-keygen env" in out
