"""disagg-epd-proxy --tensor-parallel-size N: passed to every spawned decoder and prefill worker; on GPUs each of them
gets N consecutive GPUs of its own (CUDA_VISIBLE_DEVICES, --device cuda:0), encoders round-robin over all; too few
GPUs is one line and exit 2 before anything starts. No GPU is needed: the GPU count is an argument, or faked."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd_common.startup import ConfigError
from epd_launcher import preflight, spawn
from epd_launcher.flag_types import MAX_TENSOR_PARALLEL
from epd_launcher.flags import parse_args
from epd_launcher.group import Secrets
from epd_launcher.placement import VISIBLE, Placement, place_workers
from tests.launcher.test_cli import RecordingGroup

ROOT = Path(__file__).resolve().parents[2]
CUDA = ("--device", "cuda:0")


def gpu_sets(places: list[Placement]) -> list[list[str]]:
    return [p.env[VISIBLE].split(",") for p in places]


def test_each_decoder_and_prefill_worker_gets_its_own_consecutive_gpus() -> None:
    """8 GPUs, 1 encoder, 2 decoders and 1 prefill worker at TP 2: GPUs 0-1, 2-3, 4-5; the encoder on GPU 0."""
    places = place_workers(1, 2, 1, 2, gpus=8)
    assert places[0] == Placement(CUDA, {})  # the encoder: round-robin over all, beside a decoder as with TP 1
    engines = places[1:]
    assert [p.flags for p in engines] == [CUDA] * 3
    assert gpu_sets(engines) == [["0", "1"], ["2", "3"], ["4", "5"]]
    taken = [g for gpus in gpu_sets(engines) for g in gpus]
    assert len(taken) == len(set(taken)) == 6  # none shared


def test_encoders_stay_round_robin_over_every_gpu() -> None:
    places = place_workers(3, 1, 0, 4, gpus=4)
    assert [p.flags for p in places[:3]] == [("--device", "cuda:0"), ("--device", "cuda:1"), ("--device", "cuda:2")]
    assert [p.env for p in places[:3]] == [{}, {}, {}] and gpu_sets(places[3:]) == [["0", "1", "2", "3"]]


@pytest.mark.parametrize("visible,expected", [
    ("4,5,6,7", [["4", "5"], ["6", "7"]]),
    (" 4, 5,6 ,7,", [["4", "5"], ["6", "7"]]),
    ("GPU-a,GPU-b,GPU-c,GPU-d", [["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"]]),
    ("3,1,2,0,5", [["3", "1"], ["2", "0"]]),  # a 4-GPU machine: CUDA stops at 5, torch sees 4
])
def test_an_inherited_visible_list_maps_to_its_physical_gpus(visible: str, expected: list[list[str]]) -> None:
    """The launcher started with CUDA_VISIBLE_DEVICES=4,5,6,7 sees 4 GPUs, cuda:0 being physical GPU 4: each
    decoder's list names the physical GPUs (a child's list is read against the machine, not the parent's list)."""
    places = place_workers(0, 2, 0, 2, gpus=4, visible=visible)
    assert gpu_sets(places) == expected and [p.flags for p in places] == [CUDA] * 2


def test_too_few_gpus_are_refused_naming_what_is_needed() -> None:
    with pytest.raises(ConfigError) as refused:
        place_workers(1, 2, 1, 2, gpus=4)
    assert str(refused.value) == (
        "--tensor-parallel-size 2: 2 decoder(s) and 1 prefill worker(s) need 6 GPUs (2 each, none shared), but 4 "
        "GPU(s) are visible; lower --num-decoders, --num-prefills or --tensor-parallel-size, or make more GPUs visible")
    with pytest.raises(ConfigError, match=r"1 decoder\(s\) need 4 GPUs .* but 2 GPU\(s\) are visible "
                                          r"\(CUDA_VISIBLE_DEVICES=6,7\);"):
        place_workers(0, 1, 0, 4, gpus=2, visible="6,7")
    assert gpu_sets(place_workers(0, 2, 1, 2, gpus=6)) == [["0", "1"], ["2", "3"], ["4", "5"]]  # exactly enough


@pytest.mark.parametrize("gpus", [1, 3, 8])
def test_tensor_parallel_size_1_keeps_the_round_robin(gpus: int) -> None:
    places = place_workers(2, 2, 1, 1, gpus=gpus, visible="4,5,6")
    assert places == [Placement(("--device", f"cuda:{i % gpus}"), {}) for i in range(5)]


def test_no_gpu_changes_nothing_the_ranks_share_the_cpu() -> None:
    assert place_workers(1, 2, 1, 4, gpus=0) == [Placement((), {})] * 4


def spawned(monkeypatch: pytest.MonkeyPatch, argv: list[str], gpus: int,
            visible: str | None = None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(encoder / decoder / prefill, extra arguments, extra environment) of each worker the launcher would spawn on a
    machine with `gpus` GPUs, started with CUDA_VISIBLE_DEVICES=`visible` (None: unset)."""
    monkeypatch.setenv("EPD_INSECURE", "1")
    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    if visible is None:
        monkeypatch.delenv(VISIBLE, raising=False)
    else:
        monkeypatch.setenv(VISIBLE, visible)
    _, args = parse_args(argv)
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    return [("prefill" if "prefill" in extra else role, extra, env)
            for (role, extra), env in zip(group.spawned, group.envs, strict=True)]


def test_the_launcher_places_decoders_and_prefill_workers_on_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args

    workers = spawned(monkeypatch, ["--num-encoders", "2", "--num-decoders", "2", "--num-prefills", "1",
                                    "--tensor-parallel-size", "2"], gpus=8, visible="0,1,2,3,4,5,6,7")
    assert [kind for kind, _, _ in workers] == ["encoder", "encoder", "decoder", "decoder", "prefill"]
    encoders, engines = workers[:2], workers[2:]
    assert [extra[-2:] for _, extra, _ in encoders] == [["--device", "cuda:0"], ["--device", "cuda:1"]]
    assert all(VISIBLE not in env and "--tensor-parallel-size" not in extra for _, extra, env in encoders)
    assert [env[VISIBLE] for _, _, env in engines] == ["0,1", "2,3", "4,5"]
    for _, extra, env in engines:
        assert extra[-2:] == list(CUDA) and "EPD_INTERNAL_KEY" in env  # the keys stay beside the GPUs
        cfg = decoder_args([a for a in extra if a != "--device" and not a.startswith("cuda:")])
        assert cfg.tensor_parallel_size == 2


def test_without_tensor_parallelism_the_spawned_workers_are_placed_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = spawned(monkeypatch, ["--num-encoders", "1", "--num-decoders", "2", "--num-prefills", "1"], gpus=3)
    assert [extra[-2:] for _, extra, _ in workers] == [["--device", f"cuda:{i}"] for i in (0, 1, 2, 0)]
    assert not [env for _, _, env in workers if VISIBLE in env]
    assert not [a for _, extra, _ in workers for a in extra if a == "--tensor-parallel-size"]  # not given: not passed
    on_cpu = spawned(monkeypatch, ["--num-decoders", "2", "--tensor-parallel-size", "4"], gpus=0)
    assert [kind for kind, _, _ in on_cpu] == ["encoder", "decoder", "decoder"]
    assert not [a for _, extra, env in on_cpu for a in [*extra, *env] if a in ("--device", VISIBLE)]
    assert all(extra[extra.index("--tensor-parallel-size") + 1] == "4" for kind, extra, _ in on_cpu if kind != "encoder")


def test_an_aggregated_set_places_only_its_decoders(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = spawned(monkeypatch, ["--aggregated", "--num-decoders", "2", "--num-prefills", "3",
                                    "--tensor-parallel-size", "2"], gpus=4, visible="4,5,6,7")
    assert [(kind, env[VISIBLE]) for kind, _, env in workers] == [("decoder", "4,5"), ("decoder", "6,7")]


# the launcher as its console script runs it, on a machine that seems to have `gpus` GPUs
FAKE_GPUS = """import sys
import torch
gpus = int(sys.argv.pop(1))
torch.cuda.device_count = lambda: gpus
sys.argv[0] = "disagg-epd-proxy"
from epd_launcher.cli import main
main()
"""


def launch(gpus: int, *argv: str, visible: str | None = None) -> str:
    """The one line `disagg-epd-proxy argv` writes on a machine with `gpus` GPUs, after checking it exits 2 with
    that line alone (no traceback, no worker started: the launcher logs each one it starts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_") and k != VISIBLE}
    done = subprocess.run([sys.executable, "-c", FAKE_GPUS, str(gpus), "--port", "0", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**env, **({VISIBLE: visible} if visible else {})})
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    return line


@pytest.mark.parametrize("visible", [None, "2,3,5,7"])
def test_the_launcher_refuses_too_few_gpus_in_one_line_before_any_worker_starts(visible: str | None) -> None:
    line = launch(4, "--model", "demo", "--num-decoders", "2", "--num-prefills", "1", "--tensor-parallel-size", "2",
                  visible=visible)
    seen = f"4 GPU(s) are visible{f' ({VISIBLE}={visible})' if visible else ''};"
    assert line.startswith("disagg-epd-proxy: error: --tensor-parallel-size 2: 2 decoder(s) and 1 prefill "
                           "worker(s) need 6 GPUs (2 each, none shared), but ") and seen in line, line


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts() -> None:
    """The demo model has 2 K/V heads: 4 ranks cannot share them (the decoder's own check, run by the launcher)."""
    line = launch(0, "--model", "demo", "--tensor-parallel-size", "4")
    assert line.startswith("disagg-epd-proxy: error: each decoder: model ") and \
        "--tensor-parallel-size 4 does not divide the model's num_key_value_heads 2" in line, line
    preflight.check_kv(parse_args(["--tensor-parallel-size", "2"])[1], preflight.resolve("demo"))  # 2 does


@pytest.mark.parametrize("value,ok", [("1", True), (str(MAX_TENSOR_PARALLEL), True), ("0", False),
                                      (str(MAX_TENSOR_PARALLEL + 1), False), ("two", False)])
def test_the_launcher_takes_the_sizes_the_decoder_takes(value: str, ok: bool, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args

    monkeypatch.setenv("EPD_INSECURE", "1")
    for parse in (parse_args, decoder_args):
        if ok:
            parse(["--tensor-parallel-size", value])
        else:
            with pytest.raises(SystemExit) as refused:
                parse(["--tensor-parallel-size", value])
            assert refused.value.code == 2 and "--tensor-parallel-size" in capsys.readouterr().err
