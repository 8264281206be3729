"""epd_bench.proxy_startup measures the attach-mode proxy against real workers; the proxy maps no libtorch."""
from __future__ import annotations

from pathlib import Path

import pytest

from epd_bench.proxy_startup import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_the_attach_mode_proxy_starts_and_idles_without_torch() -> None:
    result = measure(ROOT, "epd_launcher.cli", "encoder_service.cli", "decoder_service.cli", runs=1)
    assert result["libtorch_mapped"] is False and result["runs"] == 1
    assert result["startup_s_median"] > 0 and result["idle_rss_mib_median"] > 0
