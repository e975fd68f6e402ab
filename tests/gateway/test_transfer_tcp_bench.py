"""`kvstore bench transfer` sets the one-copy TCP transport's fetch beside Mooncake's raw read, the bulk
fetch and the gRPC fetch, in one run on the same bytes (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.bench.transfer_baselines import mooncake_missing


def test_bench_transfer_sets_the_tcp_fetch_beside_the_raw_read_and_the_other_paths() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "bench",
            "transfer",
            "--json",
            "--tokens",
            "4096",
            "--batches",
            "64",
            "--small",
            "",
            "--repeat",
            "1",
            "--gpu",
            "off",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=280,
    ).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    assert figures["tcp fetch"]["value"] > 0 and "one-copy TCP" in report["notes"]["tcp"]
    grpc = figures["tcp fetch vs grpc fetch"]
    assert grpc["baseline_value"] == figures["grpc fetch batch=64"]["value"]
    assert grpc["ratio"] == pytest.approx(grpc["value"] / grpc["baseline_value"])
    if mooncake_missing():
        return
    assert figures["tcp fetch vs bulk fetch"]["baseline_value"] == figures["bulk fetch batch=64"]["value"]
    raw = figures["tcp fetch vs mooncake"]
    assert raw["baseline"] == "Mooncake transfer engine TCP batch read, same bytes, in turns"
    assert raw["baseline_value"] == figures["bulk fetch vs mooncake"]["baseline_value"]
