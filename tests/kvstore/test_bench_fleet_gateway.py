"""`kvstore bench fleet-gateway` runs end to end on real etcd, `kvstore serve` and `kvstore gateway` processes and
prints every figure beside its same-run baseline, a `--before-src` tree's gateway included (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.kvstore.fleet.etcd_process import need_etcd

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_with_a_before_tree_prints_every_figure_beside_its_baseline() -> None:
    need_etcd()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "bench",
            "fleet-gateway",
            "--blocks",
            "16",
            "--run-blocks",
            "4",
            "--before-src",
            str(ROOT),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == {
        "get via the read-ahead gateway",
        "get via the read-ahead gateway vs the router",
        "get via the gateway, this tree",
        "first block of a get via the gateway, this tree",
        "put stream via the gateway, this tree",
        "put stream via the read-ahead gateway vs the router",
    }
    for f in figures.values():
        assert f["baseline"] and f["baseline_value"] > 0 and f["value"] > 0 and f["ratio"] > 0, f
    assert report["notes"]["runs"] == 4 and report["notes"]["put_batch_blocks"] == 4
    assert report["notes"]["before_src"] == str(ROOT)
