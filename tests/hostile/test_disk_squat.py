"""Another local user against the encoder's disk tier (--ec-disk-dir): a squatted folder stops the start (exit 2,
naming the folder, its owner and mode) in the launcher and in the encoder, before any model loads; and a forged
file (the right format, named for a known image's mm_hash, its MAC made without the fleet's key) is refused when
the restarted encoder indexes it: the image is encoded again and answered as itself, never as the forgery.

Making a folder another user's takes root (os.chown): that case is skipped when the tests do not run as root; the
group- and other-writable cases work as any user."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from connector.tensors.disk_format import DiskHeader, encode_head, file_key
from tests.e2e.stack import ROOT, Stack, ask_colour, demo_png, internal_key, launched, pid_alive
from tests.e2e.test_encoder_disk_restart import encoder_metric, restarted
from tests.e2e.test_supervision import BACK_WITHIN_S, poll, worker_pids

pytestmark = pytest.mark.e2e
OTHER_UID = 4242  # no one's: a user other than this process's
START_S = 60.0  # a refused start exits before loading a model: this is only the guard
RED, BLUE = demo_png("red", 6161), demo_png("blue", 6162)


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EPD_")}, "EPD_INSECURE": "1",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=START_S,
                          cwd=ROOT, env=env, check=False)


def test_the_launcher_refuses_a_disk_dir_others_can_write_before_any_worker(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # /tmp-like: anyone may make encoder-0 in it first
    done = run("epd_launcher.cli", "--model", "demo", "--port", "0", "--ec-disk-dir", str(shared))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{shared} (owner" in done.stderr and "mode 1777" in done.stderr
    assert os.listdir(shared) == []  # no encoder started, nothing made in it


@pytest.mark.parametrize("as_other_user", [
    False, pytest.param(True, marks=pytest.mark.skipif(os.geteuid() != 0, reason="os.chown to another uid needs root"))])
def test_the_encoder_refuses_a_squatted_folder_before_loading_its_model(tmp_path: Path, as_other_user: bool) -> None:
    squatted = tmp_path / "disk" / "encoder-0"  # what another user made before the encoder started
    squatted.mkdir(parents=True)
    os.chmod(tmp_path / "disk", 0o700)
    os.chmod(squatted, 0o777)
    if as_other_user:
        os.chown(squatted, OTHER_UID, OTHER_UID)
    done = run("encoder_service.cli", "--model", "demo", "--port", "0", "--insecure", "--ec-disk-dir", str(squatted))
    owner = f"uid {OTHER_UID}" if as_other_user else f"(uid {os.geteuid()})"
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{squatted} (owner" in done.stderr and owner in done.stderr and "mode 0777" in done.stderr
    assert os.listdir(squatted) == []  # no lock, no fingerprint folder: nothing used


# --- a forged file for a known image ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("squat-disk")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, disk_dir: Path) -> Iterator[Stack]:
    with launched(tmp_path_factory.mktemp("squat"), "--model", "demo", "--num-encoders", "1", "--num-decoders", "1",
                  "--health-interval", "0.5", "--restart-backoff", "0.5", "--ec-disk-dir", str(disk_dir),
                  "--ec-disk-bytes", "64MiB") as s:
        yield s


def colour(stack: Stack, image: bytes) -> str | None:
    try:
        resp = ask_colour(stack.base_url, image)
    except Exception:  # noqa: BLE001 - workers restarting: not answered yet
        return None
    return str(resp.json()["choices"][0]["message"]["content"]) if resp.status_code == 200 else None


def answered(stack: Stack, image: bytes) -> str:
    got: list[str | None] = [None]

    def check() -> bool:
        got[0] = colour(stack, image)
        return got[0] is not None
    poll("an answer", check, BACK_WITHIN_S)
    return str(got[0])


def restart_workers(stack: Stack) -> None:
    """kill -9 the encoder and the decoder (whose caches could otherwise answer); the launcher starts both again."""
    old = worker_pids(stack)
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    poll("both workers gone", lambda: not any(pid_alive(p) for p in old.values()), 30)
    poll("a new encoder and decoder", lambda: restarted(stack, old), BACK_WITHIN_S)


def files(disk_dir: Path) -> list[Path]:
    return list((disk_dir / "encoder-0").glob("*/*.emb"))


def read(path: Path) -> tuple[DiskHeader, bytes]:
    """A file's header and payload, as anyone who can read the format (not the key) can."""
    data = path.read_bytes()
    n = int.from_bytes(data[8:12], "little")
    return msgspec.msgpack.decode(data[28:28 + n], type=DiskHeader), data[28 + n:]


def forge(red_file: Path, blue_file: Path, key: bytes) -> None:
    """Red's file, rewritten to hold blue's embedding under red's mm_hash, its MACs made with `key`."""
    red, _ = read(red_file)
    blue, payload = read(blue_file)
    digest = hashlib.blake2b(payload, digest_size=16, key=key, person=b"epd-disk-payload").hexdigest()
    header = msgspec.structs.replace(blue, item=msgspec.structs.replace(blue.item, mm_hash=red.item.mm_hash),
                                     digest=digest)
    red_file.write_bytes(encode_head(header, key) + payload)


def test_a_forged_file_for_a_known_image_is_not_served(stack: Stack, disk_dir: Path) -> None:
    assert "red" in answered(stack, RED)
    poll("red's file written", lambda: encoder_metric(stack, "epd_ec_disk_writes") == 1, 60)
    (red_file,) = files(disk_dir)
    assert "blue" in answered(stack, BLUE)
    poll("blue's file written", lambda: encoder_metric(stack, "epd_ec_disk_writes") == 2, 60)
    (blue_file,) = [f for f in files(disk_dir) if f != red_file]

    forge(red_file, blue_file, key=b"")  # the attacker knows the format and the image, not the fleet's key
    restart_workers(stack)
    assert encoder_metric(stack, "epd_ec_disk_skipped_files") == 1  # refused when indexed, never advertised
    assert encoder_metric(stack, "epd_ec_disk_items") == 1
    assert "red" in answered(stack, RED)  # encoded again, answered as itself
    assert encoder_metric(stack, "epd_encoder_items_encoded_total") == 1
    assert "blue" in answered(stack, BLUE)  # the genuine file is still served from disk, not encoded again
    assert encoder_metric(stack, "epd_encoder_items_encoded_total") == 1

    # the control: the same forgery made with the fleet's key is served, so the key is what refused it above
    poll("red's file written again", lambda: encoder_metric(stack, "epd_ec_disk_writes") == 1, 60)
    forge(red_file, blue_file, key=file_key(internal_key(stack.proc.pid)))
    restart_workers(stack)
    assert encoder_metric(stack, "epd_ec_disk_skipped_files") == 0
    assert "blue" in answered(stack, RED)
