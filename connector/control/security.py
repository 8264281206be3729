"""Optional ZeroMQ CURVE encryption and client authentication for cross-host EC connector links."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import secrets
import stat
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from epd_common.cli import env_secret
from epd_common.startup import fail

logger = logging.getLogger("epd.connector.security")

ZAP_DOMAIN = "epd"
ENV_SECRET_KEY, ENV_SERVER_KEY = "EPD_EC_CURVE_SECRET_KEY", "EPD_EC_CURVE_SERVER_KEY"
ENV_ALLOWED_CLIENTS = "EPD_EC_CURVE_ALLOWED_CLIENTS"
_Z85_ALPHABET = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")
_AUTHENTICATORS: weakref.WeakValueDictionary[int, ThreadAuthenticator] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class CurveConfig:
    """CURVE keys of one node; every key is a 40-byte Z85 string."""

    secret_key: bytes
    public_key: bytes
    server_key: bytes | None = None
    allowed_clients: frozenset[bytes] | None = None


class _AllowList:
    """ZAP credentials provider that admits only the listed Z85 client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        """Return whether the client key is allowed (called by the authenticator thread)."""
        if key in self.keys:
            return True
        logger.warning("CURVE client %s rejected (domain %r)", key.decode("ascii", "replace"), domain)
        return False


def _check_z85(key: bytes, source: str) -> bytes:
    """Return key if it is a 40-character Z85 key, else raise ValueError naming source."""
    try:
        if len(key) != 40 or not set(key) <= _Z85_ALPHABET:
            raise ValueError(f"{len(key)} bytes")
        z85.decode(key)  # struct.error when a 5-char group exceeds 2**32
    except Exception as e:
        raise ValueError(f"{source}: not a 40-character Z85 CURVE key") from e
    return key


def _read_cert(path: str) -> tuple[bytes, bytes | None]:
    """Return (public, secret-or-None) from a zmq certificate file, raising ValueError naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"CURVE key file not found: {path}")
    public, secret = zmq.auth.load_certificate(path)
    return _check_z85(public, path), secret


def _secret_from_file(path: str) -> bytes:
    """Return the validated secret key of a .key_secret certificate, warning if others can read it."""
    public, secret = _read_cert(path)
    if secret is None:
        raise ValueError(f"{path}: no secret-key in file (pass the .key_secret certificate)")
    if os.stat(path).st_mode & 0o077:
        logger.warning("CURVE secret key file %s is accessible by group/others; chmod 600 it", path)
    if zmq.curve_public(_check_z85(secret, path)) != public:
        raise ValueError(f"{path}: public-key does not match secret-key")
    return secret


def _allowed_from_dir(directory: str) -> frozenset[bytes]:
    """Return the public keys of every *.key certificate in directory."""
    if not os.path.isdir(directory):
        raise ValueError(f"CURVE allowed-clients directory not found: {directory}")
    keys = frozenset(_read_cert(str(p))[0] for p in sorted(Path(directory).glob("*.key")))
    if not keys:
        raise ValueError(f"{directory}: no *.key client certificates found")
    return keys


def _allowed_from_env(env: Mapping[str, str]) -> frozenset[bytes] | None:
    """Parse the comma-separated Z85 keys of EPD_EC_CURVE_ALLOWED_CLIENTS; None when unset."""
    value = env_secret(ENV_ALLOWED_CLIENTS, env)
    if not value:
        return None
    keys = frozenset(_check_z85(k.strip().encode(), ENV_ALLOWED_CLIENTS) for k in value.split(",") if k.strip())
    if not keys:
        raise ValueError(f"{ENV_ALLOWED_CLIENTS}: no client keys listed")
    return keys


def _env_key(env: Mapping[str, str], var: str) -> bytes | None:
    """Return the validated Z85 key in env[var] (or the file env[var + "_FILE"] names), or None when unset or empty."""
    value = env_secret(var, env)
    return _check_z85(value.encode(), var) if value else None


def load_curve_config(key_file: str | None, server_key_file: str | None = None, allowed_clients_dir: str | None = None,
                      env: Mapping[str, str] = os.environ) -> CurveConfig | None:
    """Build a CurveConfig from certificate files, else EPD_EC_CURVE_* env vars (per key); None when unconfigured."""
    secret = _secret_from_file(key_file) if key_file else _env_key(env, ENV_SECRET_KEY)
    server = _read_cert(server_key_file)[0] if server_key_file else _env_key(env, ENV_SERVER_KEY)
    allowed = _allowed_from_dir(allowed_clients_dir) if allowed_clients_dir else _allowed_from_env(env)
    if secret is None:
        if server is not None or allowed is not None:
            raise ValueError(f"CURVE server key / allowed clients given without a secret key ({ENV_SECRET_KEY})")
        return None
    return CurveConfig(secret, zmq.curve_public(secret), server, allowed)


def secure_server(sock: zmq.Socket, cfg: CurveConfig | None) -> None:
    """Make sock a CURVE server before bind; with allowed_clients, start_authenticator must have run on its context."""
    if cfg is None:
        return
    if cfg.allowed_clients is not None:
        auth = _AUTHENTICATORS.get(id(sock.context))
        if auth is None or not auth.is_alive():
            raise RuntimeError("allowed_clients needs start_authenticator(ctx, cfg) on this socket's context first")
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # fail closed if the ZAP handler goes away
        except zmq.ZMQError:
            logger.debug("libzmq lacks ZMQ_ZAP_ENFORCE_DOMAIN; CURVE allow-list relies on the running authenticator")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, cfg.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, cfg.public_key)


def secure_client(sock: zmq.Socket, cfg: CurveConfig | None) -> None:
    """Make sock a CURVE client of the producers' server key (call before connect); no-op when cfg is None."""
    if cfg is None:
        return
    if cfg.server_key is None:
        raise ValueError(f"CURVE client needs the producers' public key (server key file or {ENV_SERVER_KEY})")
    sock.setsockopt(zmq.CURVE_SERVERKEY, cfg.server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, cfg.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, cfg.secret_key)


def start_authenticator(ctx: zmq.Context, cfg: CurveConfig | None) -> ThreadAuthenticator | None:
    """Start a ZAP thread on ctx admitting only cfg.allowed_clients (None if no list); the caller must .stop() it.

    libzmq allows one ZAP handler per context (inproc://zeromq.zap.01) and it then judges every CURVE server
    socket of that context, so a producer with an allow-list should own a zmq.Context(), not Context.instance().
    Call this before secure_server() and bind().
    """
    if cfg is None or cfg.allowed_clients is None:
        return None
    auth = ThreadAuthenticator(ctx, log=logger)
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_AllowList(cfg.allowed_clients))
    try:
        auth.start()
    except zmq.ZMQError as e:
        auth.stop()
        raise RuntimeError(f"cannot start CURVE authenticator (a ZAP handler already runs on this context?): {e}") from e
    _AUTHENTICATORS[id(ctx)] = auth
    return auth


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    """Write a certificate in zmq.auth format; created exclusively, mode 0600 when it holds the secret key."""
    body = f'#   Generated on {datetime.datetime.now()} by epd\nmetadata\ncurve\n    public-key = "{public.decode()}"\n'
    if secret:
        body += f'    secret-key = "{secret.decode()}"\n'
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644), "w") as f:
        f.write(body)


def generate_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (0600) into directory; never overwrites; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public_path.exists() or secret_path.exists():
        raise FileExistsError(f"refusing to overwrite existing key files {public_path} / {secret_path}")
    public, secret = zmq.curve_keypair()
    _write_cert(secret_path, public, secret)
    _write_cert(public_path, public, None)
    return public_path, secret_path


# one key per file, for docker compose `secrets:` (mounted at /run/secrets/NAME, read through EPD_*_FILE)
SECRET_FILES = ("internal_key", "api_key", "encoders_secret_key", "encoders_public_key", "clients_secret_key",
                "clients_public_key")
ENV_FILES = ("k8s-curve.env", "k8s-keys.env")  # `kubectl create secret generic --from-env-file=...`


def write_key_files(directory: Path) -> list[Path]:
    """Make one fleet's keys (the internal key, a public API key, the encoders' and the clients' CURVE key pairs)
    and write them into directory, never overwriting a file:

    - SECRET_FILES, one key each, for docker compose `secrets:`. Compose bind-mounts a secret file as it is, owner
      and mode included, and the containers run as uid 10001, so these are 0644: the directory, made 0700 (an
      existing one open to others is refused, not changed), is what keeps other local users out.
    - ENV_FILES (0600): the same keys under the Secret key names the Kubernetes manifests use (k8s-curve.env for
      epd-curve; k8s-keys.env for epd-keys, with the API key).
    """
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (mode := stat.S_IMODE(directory.stat().st_mode)) & 0o077:  # never chmod a folder of the user's (`env /tmp`)
        raise PermissionError(f"{directory} is open to other users (mode {mode:o}); the key files in it are 0644: "
                              f"`chmod 700 {directory}` or name a new directory")
    paths = [directory / name for name in (*SECRET_FILES, *ENV_FILES)]
    if any(p.exists() for p in paths):
        raise FileExistsError(f"refusing to overwrite existing key files in {directory}")
    (enc_pub, enc_sec), (cli_pub, cli_sec) = zmq.curve_keypair(), zmq.curve_keypair()
    internal, api = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    curve = {"encoders-secret-key": enc_sec.decode(), "encoders-public-key": enc_pub.decode(),
             "clients-secret-key": cli_sec.decode(), "clients-public-key": cli_pub.decode()}
    files = {"internal_key": (internal, 0o644), "api_key": (api, 0o644),
             **{name.replace("-", "_"): (value, 0o644) for name, value in curve.items()},
             "k8s-curve.env": ("".join(f"{k}={v}\n" for k, v in curve.items()), 0o600),
             "k8s-keys.env": (f"internal-key={internal}\napi-key={api}\n", 0o600)}
    for path in paths:
        text, mode = files[path.name]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        os.fchmod(fd, mode)  # whatever the umask
        with os.fdopen(fd, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    return paths


_KEYGEN_HELP = """\
Keys for EPD's internal links. The launcher (disagg-epd-proxy without worker URLs) makes its own keys on every
start and needs none of this. Attach mode, docker compose and Kubernetes are secure by default: workers refuse
to start without an internal key and CURVE keys (or --insecure).

  epd-ec-keygen env deploy/secrets     # one file per key for compose secrets, k8s-*.env for Secrets
  epd-ec-keygen generate keys --name encoders   # one certificate pair (keys/encoders.key, .key_secret)

See docs/DEPLOY.md and docs/SECURITY.md."""


def build_parser() -> argparse.ArgumentParser:
    """`epd-ec-keygen`'s flags: `generate DIR [--name NAME]` or `env DIR` (docs/FLAGS.md is generated from it)."""
    parser = argparse.ArgumentParser(prog="epd-ec-keygen", description=_KEYGEN_HELP, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", allow_abbrev=False, help="write a CURVE keypair NAME.key / NAME.key_secret into DIR "
                                          "(for the --ec-curve-* file flags)")
    gen.add_argument("directory", type=Path)
    gen.add_argument("--name", default="ec", help="file name stem (default: ec)")
    env = sub.add_parser("env", allow_abbrev=False, help="write a fleet's internal key, API key and CURVE keys into DIR (made 0700; an "
                                     "existing DIR open to other users is refused): "
                                     "one file per key for docker compose secrets (internal_key, api_key, "
                                     "encoders_secret_key, ...), and k8s-curve.env and k8s-keys.env "
                                     "(kubectl create secret generic --from-env-file)")
    env.add_argument("directory", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (`epd-ec-keygen`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        paths = generate_keypair(args.directory, args.name) if args.command == "generate" else \
            write_key_files(args.directory)
    except OSError as e:  # DIR exists, is not ours to write, or is open to other users: one line, exit 2
        fail(parser.prog, str(e))
    print(*paths, sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
