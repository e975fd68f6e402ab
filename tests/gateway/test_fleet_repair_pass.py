"""F42 in the re-replication pass: a wiped node's old id, while its lease runs, is not planned over beside the new
id at the same address (one process answers for both: counted twice, a third copy would be dropped as stale)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.fleet_repair import FleetRepairer
from kvstore.fleet.membership import NodeRecord
from kvstore.fleet.placement import placeable, superseded


def _record(node_id: str, address: str, started_at: float, *, draining: bool = False) -> NodeRecord:
    return NodeRecord(node_id=node_id, address=address, host="h", capacity_bytes=1, started_at=started_at,
                      version="test", draining=draining)


def _nodes() -> dict[str, NodeRecord]:
    return {"a": _record("a", "127.0.0.1:1", 10.0), "old-b": _record("old-b", "127.0.0.1:2", 10.0),
            "new-b": _record("new-b", "127.0.0.1:2", 50.0), "c": _record("c", "127.0.0.1:3", 10.0, draining=True)}


def test_an_older_id_at_a_shared_address_is_superseded() -> None:
    assert superseded(_nodes()) == {"old-b"}
    assert sorted(placeable(_nodes())) == ["a", "new-b"]  # placement: the latest per address, no draining one


def test_a_pass_plans_over_the_latest_id_at_each_address_and_draining_nodes() -> None:
    view: Any = SimpleNamespace(nodes=_nodes())
    nodes = FleetRepairer._pass_nodes(None, view)  # type: ignore[arg-type]  # self is not read
    assert nodes == {"a": "127.0.0.1:1", "new-b": "127.0.0.1:2", "c": "127.0.0.1:3"}
