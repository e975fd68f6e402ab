"""`kvstore bench swa` runs end to end on both backends and prints its figures as DEVELOPERS.md asks (no timing
asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


def test_bench_swa_json_figures_for_both_backends() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "swa", "--json", "--snapshots", "8", "--batch", "4",
         "--rounds", "1", "--fetches", "5", "--settle-s", "0"],
        capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    # --rounds 1 reports 1 round on both backends; the passes within a round are said apart.
    assert report["notes"]["rounds"] == report["notes"]["embedded_rounds"] == 1
    assert "3 a round" in report["notes"]["passes"] and "3 a round" in report["notes"]["embedded_passes"]
    assert {"embedded shm put throughput", "embedded shm get throughput", "embedded shm single-snapshot fetch p50",
            "embedded gateway get throughput", "direct put throughput", "direct get throughput",
            "direct single-snapshot fetch p50"} <= figures.keys()
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["value"] > 0 and f["baseline_value"] > 0 and f["baseline"]
