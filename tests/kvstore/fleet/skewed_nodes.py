"""Fleet nodes for the re-replication tests that move time: real `kvstore serve` processes against one etcd,
on one skewed clock (tests/children.py's SKEWED_CLOCK: the tiers' retention clock reads `SystemClock`, so
`clock.advance` ages every node's blocks at once; etcd's leases and the nodes' timers keep real time), with
2 s leases and a pass a second. The tests' own readings (what a node holds, its passes) build on these."""

from __future__ import annotations

import contextlib
import io
import json
import uuid
from pathlib import Path
from typing import Any

from kvstore.cli import main
from tests.children import SKEWED_CLOCK, Child, ServerClock, write_config
from tiers import datadir


class SkewedNodes:
    """The test's nodes, by name, on one skewed clock.

    Args:
        root: the folder their data dirs, configs and logs go under.
        etcd: the etcd endpoint; each instance is a cluster of its own in it.
        tokens, run_blocks, replication: `[store] block_tokens`, `[fleet] run_blocks` and `replication`.
        store: more `[store]` settings (leases, pins) for every node.
    """

    def __init__(self, root: Path, etcd: str, *, tokens: int, run_blocks: int, replication: int,
                 store: dict[str, Any] | None = None) -> None:
        self.root, self.etcd, self.cluster = root, etcd, f"t-{uuid.uuid4().hex[:12]}"
        self.tokens, self.run_blocks, self.replication = tokens, run_blocks, replication
        self.store = dict(store or {})
        self.clock = ServerClock(root / "clock-skew")
        self.children: dict[str, Child] = {}

    def data_dir(self, name: str) -> Path:
        return self.root / name / "store"

    def start(self, name: str) -> Child:
        """Start node `name` (its data dir kept across starts: the same node id)."""
        cfg = write_config(self.root / name / "kvstore.toml", {
            "store": {"data_dir": str(self.data_dir(name)), "capacity_bytes": 1 << 28, "block_tokens": self.tokens,
                      **self.store},
            "fleet": {"etcd": self.etcd, "cluster": self.cluster, "lease_ttl_s": 2, "run_blocks": self.run_blocks,
                      "replication": self.replication, "repair_interval_s": 1.0, "repair_bytes_per_s": 1 << 30},
        })
        child = self.children[name] = Child(name, ["serve", "--config", str(cfg), "--port", "0"], self.root / "logs",
                                            prelude=SKEWED_CLOCK, env=self.clock.env)
        return child

    def node_id(self, name: str) -> str:
        node = datadir.node_id(self.data_dir(name))
        assert node is not None
        return node

    def name_of(self, node_id: str) -> str:
        return next(n for n in self.children if self.node_id(n) == node_id)

    def target(self, node_id: str) -> str:
        return self.children[self.name_of(node_id)].target

    def status(self) -> dict[str, Any]:
        """`kvstore fleet status --json` of the cluster, as an operator reads it."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["fleet", "status", "--etcd", self.etcd, "--cluster", self.cluster, "--json",
                       "--timeout", "30"])  # a loaded machine answers later, not otherwise
        assert rc == 0, f"kvstore fleet status exited {rc}: {out.getvalue()}"
        return json.loads(out.getvalue())

    def repairs(self) -> dict[str, dict[str, Any]]:
        """node id -> its re-replication record, of the members."""
        return {n["node_id"]: n["repair"] for n in self.status()["nodes"] if n["repair"] is not None}
