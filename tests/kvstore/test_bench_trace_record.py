"""`kvstore bench trace-record` runs end to end and prints its figures beside their baselines (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_trace_record_json_figures(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "trace-record", "--json", "--tokens", "4096", "--repeat", "3",
         "--dir", str(tmp_path)], capture_output=True, text=True, check=True, timeout=240).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == {"Lookup of 4,096 tokens over gRPC, trace on (best)",
                            "Lookup of 4,096 tokens over gRPC, trace on (median)",
                            "recording that Lookup, on the event loop (64 hashes)",
                            "writing its record, on the writer's thread (64 hashes)"}
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["value"] > 0 and f["baseline_value"] > 0 and "trace off" in f["baseline"]
        assert f["ratio"] == f["baseline_value"] / f["value"]
    assert report["notes"]["blocks"] == 64
    assert report["notes"]["trace_files_bytes"] > 0  # the recording server wrote its trace
    assert list(tmp_path.iterdir()) == []  # scratch space removed
