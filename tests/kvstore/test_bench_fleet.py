"""`kvstore bench fleet` runs end to end on real etcd and `kvstore serve` processes and prints every figure
beside its same-run baseline, with its target met or not (docs/BENCHMARKS.md; no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.kvstore.fleet.etcd_process import need_etcd


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "fleet", *args], capture_output=True,
                          text=True, timeout=240, env=env)


def test_quick_run_every_figure_beside_its_baseline(tmp_path: Path) -> None:
    need_etcd()
    done = bench("--quick", "--json", "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    tokens = f"{report['notes']['lookup_tokens']:,}"
    want = {"put n=1 r=1", "get n=1 r=1", "get via router n=1 r=1", f"lookup {tokens} tokens n=1 r=1",
            "bytes sent to an added node 1->2 r=1",
            "put n=2 r=1", "get via router n=2 r=1", f"lookup {tokens} tokens n=2 r=1",
            "put n=2 r=2", "put r=2 vs r=1 n=2", "get n=2 r=2", "get via router n=2 r=2",
            f"lookup {tokens} tokens n=2 r=2", "bytes sent to an added node 2->3 r=2",
            "re-replication after a node kill 3->2 r=2", "re-replication vs durable writes 3->2 r=2",
            "re-replication vs raw LMDB durable puts 3->2 r=2"}
    assert want <= figures.keys(), sorted(figures)
    for f in figures.values():
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["baseline"] and f["baseline_value"] > 0 and f["value"] > 0 and f["ratio"] > 0, f
    put = figures["put r=2 vs r=1 n=2"]
    assert put["baseline_value"] == figures["put n=2 r=1"]["value"] and put["value"] == figures["put n=2 r=2"]["value"]
    assert figures["bytes sent to an added node 2->3 r=2"]["baseline_value"] == 1 / 3
    # Every figure with a target says whether it met it; the one-copy fleet says why it has no kill figure.
    for name in ("get via router n=2 r=2", f"lookup {tokens} tokens n=2 r=2", "put r=2 vs r=1 n=2",
                 "bytes sent to an added node 2->3 r=2", "re-replication after a node kill 3->2 r=2",
                 "re-replication vs durable writes 3->2 r=2"):
        assert report["notes"][f"target {name}"].endswith((": met", ": NOT MET")), name
    # Where the copies end (the store's own durable rate) is said beside them, with no target of its own.
    assert report["notes"]["target re-replication vs raw LMDB durable puts 3->2 r=2"].endswith(": no target")
    lmdb = figures["re-replication vs raw LMDB durable puts 3->2 r=2"]
    assert lmdb["value"] == figures["re-replication after a node kill 3->2 r=2"]["value"]
    assert "raw LMDB writer" in lmdb["baseline"] and lmdb["baseline_value"] != figures[
        "re-replication vs durable writes 3->2 r=2"]["baseline_value"]
    assert "skipped" in report["notes"]["re-replication n=1 r=1"]
    assert list(tmp_path.iterdir()) == []  # every node's and etcd's folder removed


def test_without_etcd_one_line_names_the_package(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no etcd on this PATH (the interpreter is named in full)
    done = bench("--quick", env=env)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["kvstore: etcd is not on PATH (apt-get install etcd-server)"]


def test_a_seeded_node_starts_under_the_id_it_was_given(tmp_path: Path) -> None:
    """The bench's fixed node ids (--placement-seed): the node serves under the given id, one per node and seed."""
    from kvstore.bench.fleet import _node_env, _store_id
    from kvstore.bench.fleet_processes import NodeProcess

    ids = {_store_id(23, 2, 2, i) for i in range(3)} | {_store_id(24, 2, 2, 0)}
    assert len(ids) == 4 and _store_id(23, 2, 2, 1) == _store_id(23, 2, 2, 1) and _store_id(-1, 2, 2, 0) is None
    given = _store_id(23, 2, 2, 0)
    assert given is not None
    node = NodeProcess(tmp_path / "node", _node_env(1 << 30), given)
    try:
        assert node.alive and node.node_id == given
    finally:
        node.stop()
