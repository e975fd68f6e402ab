"""A replica that was down when a prefix was pinned gets the pin from re-replication, with real processes: one
etcd, two `kvstore serve` nodes at replication 2, 2 s leases, a pass a second (docs/RETENTION.md R32).

Both nodes hold both runs of a prompt; one is killed (SIGKILL) and the prompt is pinned through the fleet client,
which reaches the live copy only; the killed node comes back with its data dir, holding every block but no pin.
The live node's next pass finds the missing pins in the digests and sends them: the node that was down then holds
one pin per run until the same time, charged to the tenant as on the other copy.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore
from kvstore.config_sections import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until
from tiers.lmdb_tier import LmdbBlockTier

TOKENS = 16
RUN_BLOCKS = 4
BLOCK = V4_1_FLASH.block_bytes(TOKENS)
HOUR = 3600.0
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")


class Nodes:
    """Two nodes of one cluster, by name, each on its own data dir (restarted on it: the same node)."""

    def __init__(self, root: Path, etcd: str) -> None:
        self.root, self.etcd, self.cluster = root, etcd, f"t-{uuid.uuid4().hex[:12]}"
        self.children: dict[str, Child] = {}

    def store(self, name: str) -> StoreSettings:
        return StoreSettings(data_dir=self.root / name / "store", capacity_bytes=1 << 28, block_tokens=TOKENS,
                             pin_max_hours=100.0, pin_budget_bytes=1 << 26)

    def start(self, name: str) -> Child:
        s = self.store(name)
        cfg = write_config(self.root / name / "kvstore.toml", {
            "store": {"data_dir": str(s.data_dir), "capacity_bytes": s.capacity_bytes, "block_tokens": TOKENS,
                      "pin_max_hours": s.pin_max_hours, "pin_budget_bytes": s.pin_budget_bytes},
            "fleet": {"etcd": self.etcd, "cluster": self.cluster, "lease_ttl_s": 2, "run_blocks": RUN_BLOCKS,
                      "replication": 2, "repair_interval_s": 1.0, "repair_bytes_per_s": 1 << 30},
        })
        child = self.children[name] = Child(name, ["serve", "--config", str(cfg), "--port", "0"], self.root / "logs")
        return child

    def pins(self, name: str) -> tuple[int, int]:
        """(pins, pinned bytes) of the default tenant, asked of the node itself."""
        with kvstore.Client(self.children[name].target) as direct:
            t = [t for t in direct.stats(tenant="default").tenants if t.tenant == "default"]
        return (t[0].pins, t[0].pinned_bytes) if t else (0, 0)

    def held_pins(self, name: str) -> dict[bytes, float]:
        """Each pin's block and time, read from the stopped node's store."""
        tier = LmdbBlockTier(self.store(name))
        try:
            return {p.key: p.until_s for p in tier.pins_of("default")[1]}
        finally:
            tier.close()


@pytest.fixture
def nodes(etcd_server: EtcdProcess, tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path, etcd_server.endpoint)
    try:
        yield n
    finally:
        for child in n.children.values():
            child.kill_if_alive()


def test_r32_a_node_down_when_a_prefix_was_pinned_gets_the_pin_when_it_comes_back(nodes: Nodes) -> None:
    nodes.start("a")
    nodes.start("b")
    address = f"etcd://{nodes.etcd}/{nodes.cluster}"
    tokens = [7_000 + t for t in range(2 * RUN_BLOCKS * TOKENS)]  # two runs: both on both nodes
    with kvstore.Client(address) as client:
        wait_until(lambda: len(client.view.nodes) == 2, "the fleet client seeing both nodes")
        client.put(tokens, [os.urandom(BLOCK) for _ in range(2 * RUN_BLOCKS)])
        nodes.children["b"].kill9()
        wait_until(lambda: len(client.view.nodes) == 1, "b's lease ending")
        asked = time.time() + 10 * HOUR
        got = client.pin(tokens, asked)  # reaches a's copies only
        assert (got.found_blocks, got.kept_until_s) == (2 * RUN_BLOCKS, asked)
    assert nodes.pins("a")[0] == 2  # one pin per run
    nodes.start("b")  # back, holding every block and no pin
    wait_until(lambda: nodes.pins("b") == nodes.pins("a"), "a's pass giving b the pins it missed", timeout_s=60)
    for name in ("a", "b"):
        nodes.children[name].stop()
    held = nodes.held_pins("b")
    assert held == nodes.held_pins("a") and set(held.values()) == {asked}
