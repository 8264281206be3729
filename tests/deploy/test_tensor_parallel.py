"""Tensor parallelism in deploy/: every decoder and prefill worker asks for as many GPUs as its --tensor-parallel-size
(not given: 1), and the documented N = 2 examples (the commented decoder-1 of the GPU compose file, the comment in
k8s/decoder.yaml) agree with themselves and with the files they would replace."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    COMPOSE_GPU,
    ENV_EXAMPLE,
    K8S,
    PREFILL_GPU,
    ComposeLoader,
    accepted,
    compose,
    compose_key_env,
    containers,
    deployment_of,
    env_file,
    flag,
    interpolate,
    main_container,
    resolve_k8s_vars,
    role,
)

TP = "--tensor-parallel-size"
ENGINES = ("decoder", "prefill")  # the roles that run the language model


def tp_of(command: list[str]) -> int:
    """A decoder's --tensor-parallel-size (not given: the decoder's default, 1)."""
    values = flag(command, TP)
    return int(values[0]) if values else 1


def reserved_gpus(service: dict[str, Any]) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    return list(device["device_ids"])


# --- compose ---

def commented_decoder_1(text: str) -> tuple[list[str], int, int]:
    """The GPU compose file's lines, and where its commented decoder-1 (the N = 2 variant) starts and ends."""
    lines = text.splitlines()
    start = lines.index("  # decoder-1:")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("  #"))
    return lines, start, end


def tp_variant() -> dict[str, Any]:
    """The GPU compose file as an operator who follows its comment has it: decoder-1 deleted, the commented decoder-1
    uncommented in its place; interpolated with deploy/.env.example."""
    lines, start, end = commented_decoder_1(COMPOSE_GPU.read_text())
    variant = ["  " + line.removeprefix("  # ") for line in lines[start:end]]
    first = lines.index("  decoder-1:")
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith("  ") and lines[i][2] != " ")
    assert last <= start, "the commented decoder-1 follows the decoder-1 it replaces"
    text = "\n".join([*lines[:first], *lines[last:start], *variant, *lines[end:]])
    doc: dict[str, Any] = interpolate(yaml.load(text, Loader=ComposeLoader), env_file(ENV_EXAMPLE))  # noqa: S506
    return doc


@pytest.mark.parametrize("path", [COMPOSE_GPU, PREFILL_GPU], ids=["gpu", "gpu+prefill"])
def test_compose_engines_reserve_as_many_gpus_as_their_tensor_parallel_size(path: Path) -> None:
    engines = {name: s for name, s in compose(path).items() if role(s) in ENGINES}
    assert engines
    for name, s in engines.items():
        assert len(reserved_gpus(s)) == tp_of(s["command"]), name


def test_the_commented_tensor_parallel_decoder_splits_over_two_gpus_of_its_own(
        capsys: pytest.CaptureFixture[str], key_dir: Path) -> None:
    doc = tp_variant()
    services, base = doc["services"], compose(COMPOSE_GPU)
    decoder = services["decoder-1"]
    assert tp_of(decoder["command"]) == 2 == len(reserved_gpus(decoder))
    assert decoder["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"  # the container's two devices, rank r on cuda:r
    cfg: Any = accepted("epd-decoder", decoder["command"][1:], "commented decoder-1", capsys,
                        compose_key_env(decoder, doc, key_dir))
    assert cfg.tensor_parallel_size == 2
    # the rest is decoder-1's: the same keys, volume, health check, and the proxy's URL for it unchanged
    assert decoder["command"] == [*base["decoder-1"]["command"], TP, "2"]
    same = ("image", "volumes", "secrets", "healthcheck", "networks", "restart", "init")
    assert {k: decoder[k] for k in same} == {k: base["decoder-1"][k] for k in same}
    assert {**decoder["environment"], "CUDA_VISIBLE_DEVICES": "0"} == base["decoder-1"]["environment"]
    assert services["proxy"] == base["proxy"]
    # no GPU shared with another worker, the prefill override's included
    gpus = [g for s in [*services.values(), compose(PREFILL_GPU)["prefill-0"]] if role(s) != "proxy"
            for g in reserved_gpus(s)]
    assert len(gpus) == len(set(gpus)) == 6, gpus


# --- kubernetes ---

@pytest.mark.parametrize("component", ENGINES)
def test_k8s_engines_ask_for_as_many_gpus_as_their_tensor_parallel_size(component: str) -> None:
    c = main_container(deployment_of(component))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == tp_of(resolve_k8s_vars(c))


def test_the_k8s_decoders_tensor_parallel_example_agrees_with_itself_and_the_manifest() -> None:
    """The comment in decoder.yaml: its command is the manifest's plus --tensor-parallel-size 2, its limits the
    manifest's with 2 GPUs."""
    lines = (K8S / "decoder.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"\s*# N = 2:", line)) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].lstrip().startswith("#"))
    example = yaml.safe_load(textwrap.dedent("\n".join(line.split("#", 1)[1] for line in lines[start:end])))
    c = containers(deployment_of("decoder"))["decoder"]
    assert example["command"] == [*c["command"], TP, "2"]
    assert example["limits"] == {**c["resources"]["limits"], "nvidia.com/gpu": 2} and tp_of(example["command"]) == 2
