"""Registration and the membership view against a real etcd (docs/FLEET.md F2-F8).

Every wait is on the view's own change events (`Membership.wait_until`) under a
deadline; lease expiry is etcd's, on a real 2 s lease.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvstore.config_sections import FleetSettings
from kvstore.errors import ConfigError, FailedPrecondition, Unavailable
from kvstore.fleet.endpoints import Endpoint, layout_key, node_key
from kvstore.fleet.etcd import EtcdSession
from kvstore.fleet.membership import Membership, NodeRecord, Registration, lease_ttl_s, read_nodes, session_for
from kvstore.fleet.placement import Layout

#: Longest wait for an event etcd sends at once (a put, a revoke).
EVENT_S = 10.0
#: Longest wait for a 2 s lease to expire and its key to go (etcd checks leases every 0.5 s).
EXPIRY_S = 15.0
LAYOUT = Layout(run_blocks=256, block_tokens=64)


def record(node_id: str, address: str = "127.0.0.1:50051", host: str = "testhost") -> NodeRecord:
    """A node record for tests."""
    return NodeRecord(node_id=node_id, address=address, host=host, capacity_bytes=8 * 10**12,
                      started_at=1_700_000_000.0, version="0.1.0")


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    """Run an async scenario to its end (a hung one fails the test through pytest-timeout)."""
    return asyncio.run(scenario())


async def registered(fleet: FleetSettings, rec: NodeRecord, layout: Layout | None = LAYOUT) -> Registration:
    registration = Registration(session_for(fleet), fleet.cluster, rec, ttl_s=fleet.lease_ttl_s, layout=layout)
    await registration.start()
    return registration


async def view(fleet: FleetSettings) -> Membership:
    membership = Membership(session_for(fleet), fleet.cluster, retry_s=0.2)
    await membership.start()
    return membership


def test_f3_a_registration_is_visible_under_its_lease(fleet: FleetSettings) -> None:
    async def scenario() -> None:
        registration = await registered(fleet, record("node-a"))
        try:
            session = session_for(fleet)
            nodes, _ = await read_nodes(session, fleet.cluster)
            assert [n.record for n in nodes] == [record("node-a")]
            assert nodes[0].lease_id == registration.lease_id
            assert 0 < await lease_ttl_s(session, nodes[0].lease_id) <= fleet.lease_ttl_s
            raw = await session.call(lambda c: c.get(node_key(fleet.cluster, "node-a")))
            assert json.loads(raw.value)["address"] == "127.0.0.1:50051"
            await session.close()
        finally:
            await registration.stop()

    run(scenario)


def test_f3_an_expired_lease_removes_the_node(fleet: FleetSettings) -> None:
    """A node that stops renewing (as a dead one does) leaves the view once etcd expires its lease."""
    async def scenario() -> None:
        session = session_for(fleet)
        lease = await session.call(lambda c: c.lease(2))
        await session.call(lambda c: c.put(node_key(fleet.cluster, "dead"), record("dead").to_json(), lease=lease))
        membership = await view(fleet)
        try:
            assert set(membership.nodes) == {"dead"}
            await membership.wait_until(lambda m: "dead" not in m.nodes, EXPIRY_S)  # never renewed
            assert await lease_ttl_s(session, lease.id) == -1
        finally:
            await membership.close()
            await session.close()

    run(scenario)


def test_f3_a_live_registration_outlives_its_ttl(fleet: FleetSettings) -> None:
    """Renewals keep the node in the view for longer than its lease: its lease is renewed, not re-granted.

    Time passing is observed, not slept: a probe record under a 2 s lease granted after the
    registration's, never renewed, expires; the registration must still be there each time.
    """
    async def scenario() -> None:
        registration = await registered(fleet, record("alive"))
        membership = await view(fleet)
        session = session_for(fleet)
        try:
            first = registration.lease_id
            for i in range(2):
                probe = await session.call(lambda c: c.lease(fleet.lease_ttl_s))
                key = node_key(fleet.cluster, f"probe{i}")
                await session.call(lambda c, k=key, p=probe: c.put(k, record(k.decode().rsplit("/", 1)[1]).to_json(),
                                                                  lease=p))
                await membership.wait_until(lambda m, n=f"probe{i}": n in m.nodes, EVENT_S)
                await membership.wait_until(lambda m, n=f"probe{i}": n not in m.nodes, EXPIRY_S)
                assert "alive" in membership.nodes
            assert registration.lease_id == first and registration.registrations == 1
            nodes, _ = await read_nodes(session, fleet.cluster)
            assert [(n.record.node_id, n.lease_id) for n in nodes] == [("alive", first)]
        finally:
            await registration.stop()
            await membership.close()
            await session.close()

    run(scenario)


def test_f4_a_clean_stop_removes_the_node_at_once(fleet: FleetSettings) -> None:
    async def scenario() -> None:
        registration = await registered(fleet, record("leaving"))
        lease = registration.lease_id
        await registration.stop()
        session = session_for(fleet)
        nodes, _ = await read_nodes(session, fleet.cluster)  # no waiting: the revoke deleted the key
        assert nodes == [] and registration.lease_id is None
        assert lease is not None and await lease_ttl_s(session, lease) == -1
        await session.close()

    run(scenario)


def test_f5_a_lost_lease_is_registered_again(fleet: FleetSettings) -> None:
    async def scenario() -> None:
        registration = await registered(fleet, record("phoenix"))
        membership = await view(fleet)
        session = session_for(fleet)
        try:
            lost = registration.lease_id
            await session.call(lambda c: c.revoke_lease(lost))  # as an operator's revoke or a restored etcd would
            await membership.wait_until(lambda m: "phoenix" not in m.nodes, EVENT_S)
            await membership.wait_until(lambda m: "phoenix" in m.nodes, EVENT_S)
            nodes, _ = await read_nodes(session, fleet.cluster)  # (a round trip: the registration has resumed)
            assert nodes[0].lease_id not in (0, lost) and await lease_ttl_s(session, nodes[0].lease_id) > 0
            assert registration.registrations == 2 and registration.lease_id == nodes[0].lease_id
        finally:
            await registration.stop()
            await membership.close()
            await session.close()

    run(scenario)


def test_f2_a_node_id_held_on_another_machine_is_refused(fleet: FleetSettings) -> None:
    """Two live nodes with one id (a copied data dir) would be one node to placement: the second is refused."""
    async def scenario() -> None:
        first = await registered(fleet, record("twin", "10.0.0.1:50051", host="a"))
        try:
            with pytest.raises(FailedPrecondition, match=r"node id twin is registered by 10\.0\.0\.1:50051 on a "):
                await registered(fleet, record("twin", "10.0.0.2:50051", host="b"))
            session = session_for(fleet)
            nodes, _ = await read_nodes(session, fleet.cluster)
            assert [(n.record.address, n.lease_id) for n in nodes] == [("10.0.0.1:50051", first.lease_id)]
            await session.close()
        finally:
            await first.stop()

    run(scenario)


@pytest.mark.parametrize("restarted", [record("same"), record("same", "127.0.0.1:50999"),
                                       record("same", host="renamed")])
def test_f2_a_restarted_node_takes_over_its_own_record(fleet: FleetSettings, restarted: NodeRecord) -> None:
    """A node killed -9 and restarted within its TTL, on the same machine or at the same address, finds its
    old record and takes it over."""
    async def scenario() -> None:
        session = session_for(fleet)
        old = await session.call(lambda c: c.lease(60))  # the dead process's lease, still running
        await session.call(lambda c: c.put(node_key(fleet.cluster, "same"), record("same").to_json(), lease=old))
        again = await registered(fleet, restarted)
        try:
            nodes, _ = await read_nodes(session, fleet.cluster)
            assert [(n.record, n.lease_id) for n in nodes] == [(restarted, again.lease_id)]
            assert again.lease_id != old.id
        finally:
            await again.stop()
            await session.close()

    run(scenario)


def test_f8_a_node_with_another_layout_is_refused(fleet: FleetSettings) -> None:
    async def scenario() -> None:
        first = await registered(fleet, record("n1"), LAYOUT)
        try:
            with pytest.raises(ConfigError, match="run_blocks"):
                await registered(fleet, record("n2", "127.0.0.1:2"), Layout(run_blocks=512, block_tokens=64))
            session = session_for(fleet)
            nodes, _ = await read_nodes(session, fleet.cluster)
            assert [n.record.node_id for n in nodes] == ["n1"]  # the refused node left nothing behind
            stored = await session.call(lambda c: c.get(layout_key(fleet.cluster)))
            assert Layout.from_json(stored.value) == LAYOUT
            await session.close()
            again = await registered(fleet, record("n3", "127.0.0.1:3"), LAYOUT)  # the same layout joins
            await again.stop()
        finally:
            await first.stop()

    run(scenario)


def test_f6_the_view_follows_puts_and_deletes(fleet: FleetSettings) -> None:
    async def scenario() -> None:
        membership = await view(fleet)
        session = session_for(fleet)
        try:
            assert membership.nodes == {} and not membership.stale
            a = await registered(fleet, record("a", "127.0.0.1:1"))
            b = await registered(fleet, record("b", "127.0.0.1:2"))
            await membership.wait_until(lambda m: m.node_ids == {"a", "b"}, EVENT_S)
            assert membership.nodes["b"] == record("b", "127.0.0.1:2")
            moved = record("a", "127.0.0.1:9")  # a record rewritten in place (a restart on another port)
            await session.call(lambda c: c.put(node_key(fleet.cluster, "a"), moved.to_json(), lease=a.lease_id))
            await membership.wait_until(lambda m: m.nodes.get("a") == moved, EVENT_S)
            await b.stop()
            await membership.wait_until(lambda m: m.node_ids == {"a"}, EVENT_S)
            await a.stop()
            await membership.wait_until(lambda m: not m.nodes, EVENT_S)
            assert not membership.stale
        finally:
            await membership.close()
            await session.close()

    run(scenario)


def test_f6_a_damaged_record_is_left_out_of_the_view(fleet: FleetSettings) -> None:
    async def scenario() -> None:
        session = session_for(fleet)
        await session.call(lambda c: c.put(node_key(fleet.cluster, "bad"), b"{not json"))
        await session.call(lambda c: c.put(node_key(fleet.cluster, "liar"), record("other").to_json()))
        membership = await view(fleet)
        try:
            assert membership.nodes == {}
            good = await registered(fleet, record("good"))
            await membership.wait_until(lambda m: m.node_ids == {"good"}, EVENT_S)
            await good.stop()
        finally:
            await membership.close()
            await session.call(lambda c: c.delete_prefix(node_key(fleet.cluster, "")))
            await session.close()

    run(scenario)


def test_f14_etcd_unreachable_is_unavailable_naming_every_endpoint() -> None:
    from kvstore.bench.redis_server import free_port

    ports = [free_port(), free_port()]
    dead = FleetSettings(etcd=",".join(f"127.0.0.1:{p}" for p in ports), lease_ttl_s=3)

    async def scenario() -> None:
        with pytest.raises(Unavailable) as info:
            await registered(dead, record("x"))
        assert all(f"127.0.0.1:{p}" in info.value.message for p in ports) and info.value.retryable
        with pytest.raises(Unavailable):
            await view(dead)

    run(scenario)


def test_a_session_moves_to_the_next_endpoint(etcd_server: Any) -> None:
    from kvstore.bench.redis_server import free_port

    dead = Endpoint(host="127.0.0.1", port=free_port())
    live = Endpoint(host="127.0.0.1", port=etcd_server.client_port)

    async def scenario() -> None:
        session = EtcdSession([dead, live], timeout_s=2)
        status = await session.call(lambda c: c.get(b"/kvstore/none"))
        assert status is None and session.endpoint == live
        await session.close()

    run(scenario)


def test_records_round_trip_and_refuse_what_is_not_one() -> None:
    rec = record("n")
    assert NodeRecord.from_json(rec.to_json()) == rec
    for bad in (b"[]", b'{"node_id": "n"}', b"{", json.dumps({**json.loads(rec.to_json()), "capacity_bytes": []})):
        with pytest.raises(ValueError):
            NodeRecord.from_json(bad.encode() if isinstance(bad, str) else bad)

