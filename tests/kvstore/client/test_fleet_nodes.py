"""The read order of a run's replicas (docs/FLEET.md F33): this host's first, then the client's draw, suspects last.

The pool reads only the view's `nodes` and `address` here, so a plain view of records stands in for etcd's.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore.client.fleet_address import parse_fleet_address
from kvstore.client.fleet_nodes import NodePool
from kvstore.fleet.membership import NodeRecord


def record(node_id: str, host: str) -> NodeRecord:
    return NodeRecord(node_id=node_id, address=f"{host}:1", host=host, capacity_bytes=1, started_at=0.0,
                      version="0")


@dataclass
class View:
    nodes: dict[str, NodeRecord]
    address: Any = field(default_factory=lambda: parse_fleet_address("etcd://127.0.0.1:2379/t"))


def pool(nodes: dict[str, NodeRecord], clock: list[float] | None = None) -> NodePool:
    now = clock or [0.0]
    return NodePool(View(nodes), namespace="", geometry="", timeout_s=1.0, token=None, tls=None,  # type: ignore[arg-type]
                    clock=lambda: now[0])


def test_f33_a_replica_on_this_host_is_read_first() -> None:
    here = socket.gethostname()
    nodes = {"a": record("a", "elsewhere-1"), "b": record("b", here), "c": record("c", "elsewhere-2")}
    p = pool(nodes)
    for key in (bytes([i]) * 32 for i in range(50)):
        assert p.read_order(key, ["a", "b", "c"])[0] == "b"
        assert p.read_order(key, ["a", "c"])[0] in {"a", "c"}


def test_f33_each_client_draws_its_own_order_and_keeps_it() -> None:
    nodes = {n: record(n, "elsewhere") for n in "abc"}
    first, second = pool(nodes), pool(nodes)
    keys = [bytes([i]) * 32 for i in range(64)]
    mine = [first.read_order(k, ["a", "b"])[0] for k in keys]
    assert mine == [first.read_order(k, ["b", "a"])[0] for k in keys]  # stable, whatever the placement's order
    assert 10 < mine.count("a") < 54  # spread over both replicas
    assert mine != [second.read_order(k, ["a", "b"])[0] for k in keys]  # another client, another draw


def test_f33_a_node_that_failed_is_read_last_for_a_while() -> None:
    nodes = {n: record(n, "elsewhere") for n in "ab"}
    clock = [100.0]
    p = pool(nodes, clock)
    key = next(k for k in (bytes([i]) * 32 for i in range(64)) if p.read_order(k, ["a", "b"])[0] == "a")
    p.failed("a")
    assert p.read_order(key, ["a", "b"]) == ["b", "a"] and p.failures["a"] == 1
    clock[0] += p.suspect_s
    assert p.read_order(key, ["a", "b"]) == ["a", "b"]


def test_f65_a_runs_draw_is_remembered_so_a_prompt_sent_again_is_ordered_without_hashing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """F65: the client's draw of a run's replicas is fixed by its salt, so it is hashed once per (run, replicas);
    suspects and this host still reorder a remembered draw."""
    import kvstore.client.fleet_nodes as fleet_nodes

    scored: list[str] = []
    real = fleet_nodes.score

    def counted(key: bytes, node: str) -> int:
        scored.append(node)
        return real(key, node)

    monkeypatch.setattr(fleet_nodes, "score", counted)
    nodes = {n: record(n, "elsewhere") for n in "abc"}
    p = pool(nodes)
    keys = [bytes([i]) * 32 for i in range(64)]
    first = [p.read_order(k, ["a", "b"]) for k in keys]
    assert len(scored) == 2 * len(keys)
    scored.clear()
    assert [p.read_order(k, ["a", "b"]) for k in keys] == first and scored == []
    fresh = pool(nodes)
    fresh.salt = p.salt
    assert [fresh.read_order(k, ["a", "b"]) for k in keys] == first  # what it remembers is the draw itself
    p.failed("a")
    assert all(order[:2] == ["b", "a"] for order in (p.read_order(k, ["a", "b"]) for k in keys))
