"""`kvstore bench store` runs end to end and prints its figures as DEVELOPERS.md asks (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_store_json_figures(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "store", "--json", "--gib", "0.01", "--lookup-tokens", "4096",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=240).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    assert {"put", "get", "lookup 4,096 tokens at server", "lookup 4,096 tokens over gRPC"} <= figures.keys()
    for name in ("put", "get", "lookup 4,096 tokens at server"):
        f = figures[name]
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["value"] > 0 and f["baseline_value"] > 0 and f["baseline"]
    assert figures["put"]["ratio"] == figures["put"]["value"] / figures["put"]["baseline_value"]
    assert list(tmp_path.iterdir()) == []  # scratch space removed
