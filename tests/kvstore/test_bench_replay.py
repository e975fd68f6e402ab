"""`kvstore bench replay --quick` on the CPU: the JSON's shape, and metrics that are sane (no timing asserted).

The sanity line (exact replay against the full prefill it must equal, batch
invariant on the CPU) has to read cosine 1, KL 0 and no window error, while
bounded replay over one window has to read an error above zero: a comparison
wired to the wrong states fails one or the other.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_bench_replay_quick_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "replay", "--quick", "--json", "--parts", "overhead,fidelity",
         "--device", "cpu", "--prompts", "1", "--cases", "random"],
        capture_output=True, text=True, check=True, timeout=240).stdout
    report = json.loads(out)
    assert report["bench"] == "replay"
    figures = {f["name"]: f for f in report["figures"]}
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
    plan = figures["plan 4,096 tokens"]
    assert plan["unit"] == "ms" and plan["value"] > 0 and plan["baseline_value"] > 0
    assert plan["ratio"] == plan["baseline_value"] / plan["value"]  # a time: above 1 is faster than the lookup
    assert "planner overhead beyond the lookup (median of paired runs), 4,096 tokens" in figures
    hosts = figures["plan with hosts 4,096 tokens"]  # the hosts answer's cost, beside the same plan without
    assert hosts["baseline"] == "the same plan without hosts" and hosts["value"] > 0 and hosts["baseline_value"] > 0
    notes = report["notes"]
    assert notes["overhead_plan"]["action"] == "bounded-replay"
    assert notes["fidelity_weights"].startswith("seeded random")

    by_span = notes["fidelity"]["random"]
    sanity = by_span["exact replay vs full prefill (40)"]
    assert sanity["samples"] == 1
    assert sanity["cosine_mean"] == 1.0 and sanity["kl_mean"] == 0.0 and sanity["top1_agreement"] == 1.0
    assert sanity["window_error_max"] == 0.0 and sanity["max_diff_of_range_max"] == 0.0

    bounded = by_span["1x window (8 tokens)"]
    assert bounded["window_error_per_layer"][0] == 0.0  # layer 0's window sees only the W tokens replayed
    assert bounded["window_error_max"] > 0.0 and bounded["kl_max"] > 0.0
    assert 0.9 < bounded["cosine_mean"] <= 1.0 and 0.0 <= bounded["top1_agreement"] <= 1.0
    assert len(bounded["window_error_per_layer"]) == 5
    cos = figures["bounded replay 1x window, random: 1 - cosine, mean"]
    assert cos["value"] == (1.0 - bounded["cosine_mean"]) * 1e6 and cos["unit"] == "ppm"
    assert cos["baseline_value"] == 0.0  # the sanity line's
    kl = figures["bounded replay 1x window, random: KL per continued token, mean"]
    assert kl["value"] == bounded["kl_mean"] * 1e6 > 0.0 and kl["unit"] == "unat" and kl["baseline_value"] == 0.0
    assert notes["tail_prefill"]["samples"] == 1
    assert set(notes["tables"]) == {"fidelity", "boundaries", "per_layer", "intervals"}
