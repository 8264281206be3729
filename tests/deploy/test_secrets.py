"""Nothing under deploy/ looks like a committed key, by a scanner shown to find every kind of key."""
from __future__ import annotations

import re

import zmq

from tests.deploy.manifests import (
    ENV_EXAMPLE,
    ROOT,
    deploy_files,
    env_file,
)

_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_ZMQ_CERT = re.compile(r"(public|secret)-key\s*=\s*\"")
_Z85 = r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]"
_Z85_KEY = re.compile(rf"(?<!{_Z85}){_Z85}{{40}}(?!{_Z85})")
_ASSIGNED = re.compile(r"""(?<![{\w])(\w*(?:KEY|TOKEN|SECRET|PASSWORD)\w*)["']?[ \t]*[=:][ \t]*(\S*)""")


def secrets_in(text: str) -> list[str]:
    found = [m[0] for m in _PEM.finditer(text)] + [m[0] for m in _ZMQ_CERT.finditer(text)]
    found += [k for k in _Z85_KEY.findall(text) if re.search(r"[a-z]", k) and re.search(r"[A-Z]", k)]
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))  # not prose
    for name, value in _ASSIGNED.findall(code):
        value = value.strip("'\"")
        if re.fullmatch(f"{_Z85}{{40}}", value):  # a CURVE key, whatever its first character
            found.append(f"{name}={value}")
        # not a variable, a path (EPD_*_FILE names a key, holds none) or an expression (`str(path)`, `""}`)
        elif re.search(r"\w", value) and "(" not in value and not value.startswith(("$", "{", "#", "/", "./")):
            found.append(f"{name}={value}")
    return found


def test_the_secret_scanner_finds_keys() -> None:
    public, secret = zmq.curve_keypair()
    for first in "{$#/(":  # a key may start with any Z85 character
        assert secrets_in(f"EPD_EC_CURVE_SECRET_KEY={first}{secret.decode()[1:]}")
    assert secrets_in(f"EPD_EC_CURVE_SECRET_KEY={secret.decode()}")
    assert secrets_in(f'    secret-key = "{secret.decode()}"') and secrets_in(f"server: {public.decode()}")
    assert secrets_in("-----BEGIN OPENSSH PRIVATE KEY-----") and secrets_in("EPD_API_KEY=sk-abc123")
    assert secrets_in("      EPD_INTERNAL_KEY: hunter2") and secrets_in('{"HF_TOKEN": "hf_abc"}')
    assert not secrets_in("EPD_API_KEY=\n  EPD_INTERNAL_KEY: ${EPD_INTERNAL_KEY:?set it}\n")
    assert not secrets_in("  EPD_INTERNAL_KEY_FILE: /run/secrets/internal_key\n  env = {'EPD_API_KEY': str(path)}")


def test_nothing_under_deploy_looks_like_a_committed_secret() -> None:
    found = {str(p.relative_to(ROOT)): secrets_in(p.read_text()) for p in deploy_files()}
    assert {p: s for p, s in found.items() if s} == {}
    named_like_keys = {k: v for k, v in env_file(ENV_EXAMPLE).items() if re.search(r"KEY|TOKEN|SECRET", k)}
    assert named_like_keys == {"HF_TOKEN": "", "EPD_SECRETS_DIR": "./secrets"}  # a folder, not a key
