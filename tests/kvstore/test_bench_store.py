"""`kvstore bench store` runs end to end and prints its figures as DEVELOPERS.md asks (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_store_json_figures(tmp_path: Path) -> None:
    out = subprocess.run(
        # One auth round (4 by default, each two fresh servers) of 50 one-block Lookups (1000): the figures, not
        # their spread, are checked. kvstore's events decoder: vLLM's import alone took 45 of the test's 73 s.
        [sys.executable, "-m", "kvstore.cli", "bench", "store", "--json", "--gib", "0.01", "--lookup-tokens", "4096",
         "--auth-rounds", "1", "--auth-one-calls", "50", "--events-rounds", "1", "--events-batches", "200",
         "--events-decoder", "kvstore", "--dir", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=240).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    assert {"put", "get", "lookup 4,096 tokens at server", "lookup 4,096 tokens over gRPC", "get with auth",
            "lookup 4,096 tokens over gRPC with auth", "lookup 1 block over gRPC with auth (median)"} <= figures.keys()
    events = ("put with events on (a subscriber decoding)", "events one subscriber decodes (64-block batches)")
    for name in ("put", "get", "lookup 4,096 tokens at server", *events):
        f = figures[name]
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["value"] > 0 and f["baseline_value"] > 0 and f["baseline"]
    assert figures["put"]["ratio"] == figures["put"]["value"] / figures["put"]["baseline_value"]
    # Group commit: the service's commits are counted beside its batches, and put is also set against raw
    # LMDB making as many commits (the per-batch baseline alone credits the service with fewer fsyncs).
    notes = report["notes"]
    assert 1 <= notes["put_commits"] <= notes["put_batches"] == notes["raw_commits"]
    # Where the put phase's CPU went: the server (and its event loop's thread, part of it), the client, raw LMDB.
    assert notes["put_client_cpu_s"] > 0 and notes["put_raw_cpu_s"] > 0
    assert notes["put_client_minor_faults"] >= 0 and notes["put_raw_minor_faults"] >= 0
    if sys.platform.startswith("linux"):  # read from /proc
        assert 0 <= notes["put_server_loop_cpu_s"] <= notes["put_server_cpu_s"]
        assert notes["put_server_minor_faults"] > 0
    # The put by `Client.put`'s default path (rounds of 1.3 MB here: below the TCP transport's threshold), and
    # by gRPC, both against the same raw LMDB.
    assert notes["put_transport"].startswith("grpc in 8 of 8 rounds (below put_tcp.TCP_PUT_MIN_BYTES")
    by_grpc = figures["put over gRPC (PutStream)"]
    assert by_grpc["value"] > 0 and by_grpc["baseline_value"] == figures["put"]["baseline_value"]
    same = figures["put, raw LMDB at the service's commit count"]
    assert same["value"] == figures["put"]["value"] and same["baseline_value"] > 0
    assert list(tmp_path.iterdir()) == []  # scratch space removed
    assert "lookup_tokens" not in report["notes"]  # the 4,096 asked are the 4,096 measured


def test_a_shorter_lookup_than_asked_says_why() -> None:
    """`--lookup-tokens 65536 --gib 0.05` measures the 942 blocks stored, 60,288 tokens, and says so."""
    import argparse

    from kvstore.bench.store import lookup_note

    args = argparse.Namespace(block_tokens=64, gib=0.05)
    assert lookup_note(65_536, 942, 942, args) == (
        "60,288 of the 65,536 asked: only 942 blocks are stored (--gib 0.05): raise --gib for a longer lookup")
    assert lookup_note(4_100, 64, 942, args) == "4,096 of the 4,100 asked: a lookup covers whole 64-token blocks only"
