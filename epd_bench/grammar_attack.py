"""The grammar-compile attack (costly schemas, each client leaving early) on a loopback stack: an ordinary user's time to first token while
N constrained requests with costly schemas arrive, each dropped by its client after `--drop-after` seconds.

    python -m epd_bench.grammar_attack [--source DIR] [--attackers 6] [--keys 300] [--shape attack|bounded]

It starts `disagg-epd-proxy --model demo` (launcher mode: one encoder, one decoder) from `--source` (a checkout;
default this one, so the same script measures an older tree side by side), times the victim's image request alone,
then again 0.5 s after the attackers, and prints one JSON line. `attack`: the hostile schema (`--keys`
patternProperties keys `^<tag>{i}(a|b)*c$`, a fresh tag per request so no compile is cached); `bounded`: the
costliest schema within the bounds of epd_contracts/schema_checks.py (4 objects x 16 overlapping-checked keys).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from epd_builders.shapes import draw_shape
from epd_launcher.group import free_port

ROOT = Path(__file__).resolve().parent.parent


def attack_schema(tag: str, keys: int) -> dict[str, Any]:
    return {"type": "object", "patternProperties": {f"^{tag}{i}(a|b)*c$": {"type": "string"} for i in range(keys)}}


def bounded_schema(tag: str) -> dict[str, Any]:
    """4 objects of 16 keys whose pairwise overlap checks run near the library's fuel (measured: 0.34 s)."""
    return {"type": "object", "properties": {f"p{j}": {"type": "object", "patternProperties": {
        f"^{tag}{j}_(a|b)*a(a|b){{{12 + i % 4}}}x{i}$": {"type": "string"} for i in range(16)}} for j in range(4)}}


def image_url(seed: int) -> str:
    import random

    buf = io.BytesIO()
    draw_shape("red", "circle", random.Random(seed)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def victim_body(seed: int) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": image_url(seed)}},
               {"type": "text", "text": "What color is the shape?"}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "stream": True}


def attacker_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Describe a shape."}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


async def ttft(client: httpx.AsyncClient, url: str, seed: int) -> float:
    """Seconds from sending the victim's request to its first content delta."""
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=victim_body(seed), timeout=600) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the victim's stream ended without content")


async def attacker(url: str, schema: dict[str, Any], drop_after: float) -> str:
    """One costly request, dropped (the connection closed) after `drop_after` seconds unless answered first."""
    try:
        async with httpx.AsyncClient(timeout=drop_after) as client:
            resp = await client.post(f"{url}/v1/chat/completions", json=attacker_body(schema))
            return str(resp.status_code)
    except httpx.TimeoutException:
        return "dropped"


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        await ttft(client, url, 1)  # warm-up: first-use costs (the grammar tables are built by the attack's first)
        solo = await ttft(client, url, 2)
        schemas = [attack_schema(secrets.token_hex(3), args.keys) if args.shape == "attack"
                   else bounded_schema(secrets.token_hex(3)) for _ in range(args.attackers)]
        attacks = [asyncio.create_task(attacker(url, s, args.drop_after)) for s in schemas]
        await asyncio.sleep(0.5)
        under_attack = await ttft(client, url, 3)
        outcomes = await asyncio.gather(*attacks)
    return {"solo_ttft_s": round(solo, 3), "attack_ttft_s": round(under_attack, 3),
            "ratio": round(under_attack / solo, 1), "attackers": outcomes,
            "schema_bytes": len(json.dumps(schemas[0], separators=(",", ":")))}


def start_stack(source: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(source), "EPD_INSECURE": "1"}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "epd_launcher.cli", "--model", "demo", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=source, env=env, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the stack exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the stack did not become ready")


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the launcher and the workers it spawned
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="grammar-attack-")) / "stack.log"
    proc = start_stack(args.source.resolve(), port, log)
    try:
        wait_ready(url, proc)
        result = asyncio.run(measure(url, args))
    finally:
        stop_stack(proc)
    return {"source": str(args.source), "shape": args.shape, "keys": args.keys, "drop_after_s": args.drop_after,
            **result}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m epd_bench.grammar_attack", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=ROOT, help="checkout whose stack is measured (default: this one)")
    p.add_argument("--attackers", type=int, default=6, help="costly requests sent at once")
    p.add_argument("--keys", type=int, default=300, help="attack shape: patternProperties keys per schema")
    p.add_argument("--shape", choices=("attack", "bounded"), default="attack")
    p.add_argument("--drop-after", type=float, default=1.0, help="seconds before each attacker leaves")
    print(json.dumps(run(p.parse_args(argv))))


if __name__ == "__main__":
    main()
