"""`kvstore bench lookup` runs end to end and prints its figures as DEVELOPERS.md asks (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_lookup_json_figures(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "bench",
            "lookup",
            "--json",
            "--tokens",
            "8192",
            "--new-tokens",
            "256",
            "--repeat",
            "2",
            "--list-tokens",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    ).stdout
    report = json.loads(out)
    figures = {f["name"]: f for f in report["figures"]}
    nt = "lookup next turn of 8,192 tokens (+256)"
    turn = f"{nt} over gRPC, chain memo"
    assert {
        f"{turn} + anchor",
        f"{nt} through Client.lookup, C1's compare on a worker (vs serial)",
        f"{turn} + anchor (vs raw echo)",
        f"{turn} + anchor, tokens as a list",
        f"{turn} only (whole chain sent)",
        "lookup next turn of 8,192 tokens (+256), its request by a bare stub (vs raw echo)",
        "lookup next turn of 8,192 tokens (+256), its request by a bare stub, back to back (vs raw echo)",
        "lookup next turn of 8,192 tokens (+256), the client's chain memo alone",
        f"{nt}, the memo overlapped: the echo's stream opened before it (vs serial)",
        f"{nt}, the memo overlapped: the echo pinged before it (vs serial)",
        f"{nt}, C1's compare on a worker while the request flies (vs compared first)",
        "lookup 8,192 tokens cold over gRPC, hashes packed",
        "lookup 8,192 tokens cold over gRPC, hashes packed (vs server)",
        "lookup 8,192 tokens cold from tokens (every token hashed)",
    } <= figures.keys()
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["value"] > 0 and f["baseline_value"] > 0 and f["baseline"]
        assert f["ratio"] == f["baseline_value"] / f["value"]  # times: above 1 is faster than the baseline
    assert report["notes"]["tokens"] == 8192 and "targets" in report["notes"]
    # What crosses the wire on a next turn: the anchor and the 4 new blocks' hashes, not the 128 before them.
    wire = report["notes"]["wire_bytes"]
    assert 4 * 32 < wire["turn_request"] < 128 * 32 < wire["cold_request"] and 0 < wire["turn_reply"] < 32
    assert "client memo" in report["notes"]["budget_ms"] and "anchored walk" in report["notes"]["budget_ms"]
    assert "C1's compare" in report["notes"]["budget_ms"]
    assert "with C1's compare on a worker" in report["notes"]["budget_ms"]
    assert isinstance(report["notes"]["overlap_compare"], bool)
    assert isinstance(report["notes"]["native_chain_hashes"], bool)
    assert list(tmp_path.iterdir()) == []  # scratch space removed
