"""`kvstore bench trace` runs on small slices and reports its figures beside a same-run baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_bench_trace_reports_simulation_against_reading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "trace", "--weka", str(FIXTURES / "weka_session.json"),
                 "--mooncake", str(FIXTURES / "mooncake.jsonl"), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [f["name"] for f in report["figures"]]
    assert names == ["weka: simulate 6 requests", "weka: requests simulated per s", "weka: simulate, CPU",
                     "mooncake: simulate 60 requests", "mooncake: requests simulated per s", "mooncake: simulate, CPU"]
    for f in report["figures"]:
        assert f["baseline"] and f["baseline_value"] > 0 and f["ratio"] > 0
    assert report["notes"]["mooncake_cpu_s"]["target_simulate_s"] == 10.0
    assert report["notes"]["mooncake_cpu_s"]["target_met_by_cpu"] is True  # 60 lines: well under 10 s
