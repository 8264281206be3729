"""deploy/smoke.py: the CPU compose stack for real (build, up, answer, kill an encoder, take it back, crash, down).

Runs when EPD_DEPLOY_SMOKE=1 and a Docker engine with the compose plugin answers (.ci/run sets both up where it
can: deploy/tools/docker-host.sh); skipped with the reason otherwise. `make deploy-smoke` runs the script alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.manifests import deploy_script

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["build", "refuse", "up", "answer", "prefill", "kill", "take-back", "crash", "down"]


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # a first build debootstraps a base and fetches the wheels: 3-4 minutes here, more on a slow mirror
def test_the_cpu_compose_stack_runs_for_real(tmp_path: Path) -> None:
    if os.environ.get("EPD_DEPLOY_SMOKE") != "1":
        pytest.skip("the deploy smoke test builds images and runs containers: set EPD_DEPLOY_SMOKE=1 "
                    "(make deploy-smoke; .ci/run does where Docker can run)")
    if reason := deploy_script(ROOT / "deploy" / "smoke.py").docker_missing():
        pytest.skip(f"deploy smoke test: {reason}")
    out = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, "deploy/smoke.py", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    phases = record["phases"]
    assert record["ok"] and list(phases) == PHASES
    assert phases["build"]["bytes"]["epd-proxy:latest"] <= 300e6  # the torch-free proxy image stays small
    assert [a.split("-> ")[1] for a in phases["answer"]["answers"]] == ["'red'", "'circle'"]
    assert phases["kill"]["answered_without_it"] == 8
    assert phases["answer"]["handoffs"] >= 1  # E -> P -> D: prefilled on prefill-0, decoded on decoder-0
    assert phases["prefill"]["answered_without_it"] == 4  # E + PD while the prefill worker is gone...
    assert phases["prefill"]["handed_off_again"] == 1  # ...and hand-offs again once it is back
    for name in ("take-back", "crash"):
        assert phases[name]["requests_until_it_encoded"] >= 1
    assert phases["down"]["left_behind"] == {}
