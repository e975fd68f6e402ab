"""The hosts answer's arithmetic (kvstore/prefix_hosts.py) and a fleet pin's combined answer
(kvstore/client/fleet_pins.py): the parts that need no server. The servers' answers are tested in
tests/replay/test_plan_hosts.py and tests/kvstore/fleet/test_fleet_hosts_pins.py."""

from __future__ import annotations

from kvstore.client.fleet_pins import CopyGrant, combine
from kvstore.fleet.membership import NodeRecord
from kvstore.fleet.placement import RunPlacement
from kvstore.prefix_hosts import PrefixHost, fleet_hosts
from kvstore.v1 import kvstore_pb2 as pb


def _record(node: str, host: str, data_dir: str = "") -> NodeRecord:
    return NodeRecord(node_id=node, address=f"{node}:1", host=host, capacity_bytes=1, started_at=0.0, version="x",
                      host_id=f"boot-{host}", data_dir=data_dir)


def test_fleet_hosts_name_each_live_replica_with_the_found_part_of_its_runs() -> None:
    runs = [RunPlacement(run=0, first_block=0, end_block=4, replicas=("a", "b")),
            RunPlacement(run=1, first_block=4, end_block=8, replicas=("a", "c")),
            RunPlacement(run=2, first_block=8, end_block=12, replicas=("gone", "b")),
            RunPlacement(run=3, first_block=12, end_block=16, replicas=("c", "b"))]
    nodes = {"a": _record("a", "h1", "/d/a"), "b": _record("b", "h2"), "c": _record("c", "h1", "/d/c")}
    hosts = {h.node_id: h for h in fleet_hosts(runs, 10, nodes)}  # the prefix ends inside run 2
    assert hosts["a"].block_ranges == ((0, 8),)  # runs 0 and 1, joined
    assert hosts["b"].block_ranges == ((0, 4), (8, 10))
    assert hosts["c"].block_ranges == ((4, 8),)  # run 3 lies past the found prefix
    assert "gone" not in hosts  # left the membership
    assert (hosts["a"].colocated, hosts["a"].data_dir, hosts["a"].host_id) == (True, "/d/a", "boot-h1")
    assert hosts["b"].colocated is False  # registered no data dir (a node older than the hosts answer)
    assert [h.node_id for h in fleet_hosts(runs, 10, nodes)] == ["a", "b", "c"]  # most blocks first
    assert hosts["b"].blocks == 6 and hosts["b"].blocks_below(9) == 5
    assert fleet_hosts(runs, 0, nodes) == ()


def test_a_prefix_host_crosses_the_wire_and_a_malformed_range_holds_less() -> None:
    host = PrefixHost(node_id="n", host="h", host_id="b", address="a:1", block_ranges=((0, 4), (8, 10)),
                      colocated=True, data_dir="/d")
    assert PrefixHost.from_pb(host.to_pb()) == host
    odd = pb.PrefixHost(node_id="n", block_ranges=[0, 4, 9, 7, 12])  # an empty range and a lone bound
    assert PrefixHost.from_pb(odd).block_ranges == ((0, 4),)
    assert host.to_dict()["blocks"] == 6


def test_a_fleet_pin_answers_the_earliest_copy_and_names_those_that_kept_less() -> None:
    asked = 1000.0
    same = [CopyGrant(node=n, run=r, kept_until_s=asked) for n in "ab" for r in range(3)]
    assert combine(asked, same).kept_until_s == asked and combine(asked, same).note == ""
    short = [*same, CopyGrant(node="c", run=1, kept_until_s=500.0, note="capped at the tenant's longest pin")]
    got = combine(asked, short)
    assert got.kept_until_s == 500.0
    assert got.note == "1 of 7 copies kept less: node c, run 1: capped at the tenant's longest pin"
    many = [CopyGrant(node=f"n{i}", run=i, kept_until_s=0.0, note="over budget") for i in range(6)]
    assert combine(asked, many).note.endswith("; and 2 more copies") and combine(asked, many).kept_until_s == 0
    assert combine(asked, []).note == "nothing was found to keep"
