"""`kvstore bench transfer` runs end to end and prints its figures as DEVELOPERS.md asks (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_bench_transfer_json_figures_with_the_direct_gpu_part() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "transfer", "--json", "--tokens", "8192", "--batches", "8,64",
         "--small", "1", "--small-calls", "10", "--repeat", "1"],
        capture_output=True, text=True, check=True, timeout=280).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    assert {"shm fetch batch=64", "grpc fetch batch=64", "shm fetch of 1 p50 vs unary",
            "grpc fetch batch=64 vs raw gRPC"} <= figures.keys()
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
    raw = figures["grpc fetch batch=64 vs raw gRPC"]
    assert raw["baseline_value"] > 0 and raw["ratio"] == pytest.approx(raw["value"] / raw["baseline_value"])
    if _cuda():
        assert any(name.startswith("direct gpu restore") for name in figures)
    else:  # the direct GPU part is wired in: it says why it did not run
        assert "no CUDA" in report["notes"]["direct gpu"]


def test_direct_gpu_figures_name_the_prompt_length_they_moved() -> None:
    from kvstore.bench.transfer_direct import tokens_label

    assert tokens_label(1_000_000) == "1M tokens"
    assert tokens_label(262_144) == "262,144 tokens"
