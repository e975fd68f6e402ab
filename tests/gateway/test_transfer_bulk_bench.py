"""`kvstore bench transfer` sets the bulk transport and Mooncake's raw batch read beside the
gRPC fetch, in one run on the same bytes (no timing asserted), or says why it could not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.bench.transfer_baselines import MOONCAKE_FIX, mooncake_missing


def test_bench_transfer_sets_the_bulk_path_and_mooncake_beside_grpc() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "transfer", "--json", "--tokens", "8192", "--batches", "64",
         "--small", "", "--repeat", "1", "--gpu", "off"],
        capture_output=True, text=True, check=True, timeout=280).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    if mooncake_missing():  # wired in, and says why and how to fix it
        assert MOONCAKE_FIX in report["notes"]["mooncake"] and "bulk" in report["notes"]
        return
    for name, baseline in (("grpc fetch vs mooncake", "Mooncake transfer engine TCP batch read, same bytes"),
                           ("bulk fetch vs mooncake", "Mooncake transfer engine TCP batch read, same bytes"),
                           ("bulk fetch vs grpc fetch", "grpc fetch batch=64, same run")):
        f = figures[name]
        assert f["baseline"] == baseline and f["unit"] == "GB/s" and f["baseline_value"] > 0
        assert f["ratio"] == pytest.approx(f["value"] / f["baseline_value"])
    assert figures["bulk fetch vs grpc fetch"]["baseline_value"] == figures["grpc fetch batch=64"]["value"]
    assert figures["bulk fetch vs mooncake"]["value"] == figures["bulk fetch batch=64"]["value"]
