"""`kvstore bench fleet-swa` runs end to end on a real Redis Cluster, etcd and `kvstore serve` processes and prints
every figure beside its same-run baseline, with its target met or not (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.redis_server import redis_server_path
from tests.kvstore.fleet.etcd_process import need_etcd


def test_quick_run_every_figure_beside_its_baseline(tmp_path: Path) -> None:
    need_etcd()
    if redis_server_path() is None:
        pytest.skip("redis-server is not on PATH")
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "fleet-swa", "--quick", "--nodes", "2",
                           "--snapshots", "2", "--runs", "2", "--repeat", "1", "--json", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == {"swa put via fleet (2 snapshots)", "swa get via fleet (2 snapshots)",
                            "transfer fetch via fleet (32 blocks, stream path)",
                            "transfer fetch via fleet (32 blocks, shm path, every node on this host)",
                            "fleet fetch, one node this host's (32 blocks, its runs shm, the rest streamed)",
                            f"lookup with swa candidates via fleet ({report['notes']['lookup_tokens']:,} tokens)"}
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["baseline"] and f["baseline_value"] > 0 and f["value"] > 0 and f["ratio"] > 0, f
        if not f["name"].startswith("fleet fetch, one node"):  # no target: most of its runs stream
            assert report["notes"][f"target {f['name']}"].endswith((": met", ": NOT MET"))
    assert "fleet path" not in report["notes"] and "single path" not in report["notes"]  # both went direct
    assert list(tmp_path.iterdir()) == []  # every process's folder removed
