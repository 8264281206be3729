"""`GET /instances` on a proxy in attach mode run `--insecure` lists the workers, as the README says (a new user met a
refusal there); adding and removing workers stays refused without the internal key."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import httpx

from epd_bench.proxy_servers import FakeDecoder
from tests.ports import REUSE_PORT_ENV, PortHolds


def _attach_insecure(decoder_url: str, port: int) -> subprocess.Popen[bytes]:
    """`disagg-epd-proxy --insecure` in attach mode, with no internal key anywhere (the open setup of the README)."""
    cmd = [sys.executable, "-m", "epd_launcher.cli", "--aggregated", "--decode-servers-urls", decoder_url,
           "--insecure", "--port", str(port), "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_INTERNAL_KEY")}
    return subprocess.Popen(cmd, env={**env, **REUSE_PORT_ENV}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


async def _until_ready(client: httpx.AsyncClient, proc: subprocess.Popen[bytes]) -> None:
    """Until /ready answers 200 (the proxy serves and its decoder is healthy); fails at once if the proxy exited."""
    async with asyncio.timeout(120):
        while True:
            assert proc.poll() is None, f"the proxy exited with code {proc.returncode}"
            try:
                if (await client.get("/ready")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)


async def _calls(port: int) -> dict[str, Any]:
    decoder = FakeDecoder()
    await decoder.start()
    proc = _attach_insecure(decoder.url, port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await _until_ready(client, proc)
            listed = await client.get("/instances")
            add = await client.post("/instances", json={"role": "decoder", "url": "http://127.0.0.1:1"})
            remove = await client.request("DELETE", "/instances", json={"role": "decoder", "url": decoder.url})
            after = await client.get("/instances")
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
        await decoder.close()
    return {"decoder": decoder.url, "listed": listed, "add": add, "remove": remove, "after": after}


def test_an_insecure_attach_proxy_lists_its_workers_and_refuses_changes(port_holds: PortHolds) -> None:
    calls = asyncio.run(_calls(port_holds.take()))
    listed = calls["listed"]
    assert listed.status_code == 200, listed.text
    assert [w["url"] for w in listed.json()["decoders"]] == [calls["decoder"]] and listed.json()["encoders"] == []
    assert listed.json()["decoders"][0]["healthy"] is True
    for change in (calls["add"], calls["remove"]):  # no internal key: registration is off
        assert change.status_code == 403 and change.json()["error"]["code"] == "registration_disabled"
    assert [w["url"] for w in calls["after"].json()["decoders"]] == [calls["decoder"]]  # still there
