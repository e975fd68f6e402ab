"""When etcd goes away (docs/FLEET.md F7, F15): the view keeps its last set and says it is stale; a member's
loss in a three-member etcd is ridden through on the others."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config_sections import FleetSettings
from kvstore.errors import Unavailable
from kvstore.fleet.endpoints import node_key
from kvstore.fleet.membership import Membership, NodeRecord, Registration, read_nodes, session_for
from tests.kvstore.fleet.etcd_process import EtcdProcess

EVENT_S = 15.0
#: A member's loss is seen when its TCP connection drops; a new leader takes a few election timeouts.
FAILOVER_S = 30.0


def record(node_id: str, port: int = 50051) -> NodeRecord:
    return NodeRecord(node_id=node_id, address=f"127.0.0.1:{port}", host="testhost", capacity_bytes=10**12,
                      started_at=1_700_000_000.0, version="0.1.0")


async def join(fleet: FleetSettings, rec: NodeRecord) -> Registration:
    registration = Registration(session_for(fleet), fleet.cluster, rec, ttl_s=fleet.lease_ttl_s)
    await registration.start()
    return registration


async def join_retrying(fleet: FleetSettings, rec: NodeRecord) -> Registration:
    deadline = asyncio.get_running_loop().time() + FAILOVER_S
    while True:
        try:
            return await join(fleet, rec)
        except Unavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)  # a retry's backoff, not a wait for time to pass


async def watch(fleet: FleetSettings) -> Membership:
    membership = Membership(session_for(fleet), fleet.cluster, retry_s=0.2)
    await membership.start()
    return membership


def test_f7_etcd_killed_leaves_the_last_view_marked_stale(own_etcd: EtcdProcess) -> None:
    fleet = FleetSettings(etcd=own_etcd.endpoint, cluster="outage", lease_ttl_s=4)

    async def scenario() -> None:
        registration = await join(fleet, record("n1"))
        membership = await watch(fleet)
        try:
            assert set(membership.nodes) == {"n1"} and not membership.stale
            own_etcd.stop()  # SIGKILL
            await membership.wait_until(lambda m: m.stale, EVENT_S)
            assert set(membership.nodes) == {"n1"} and membership.stale_s >= 0  # the data plane routes on
            await asyncio.to_thread(own_etcd.start)  # same ports, same data: leases come back with it
            await membership.wait_until(lambda m: not m.stale, EVENT_S)
            assert set(membership.nodes) == {"n1"}
            # The view follows again: a node joining now is seen.
            second = await join(fleet, record("n2", 50052))
            await membership.wait_until(lambda m: m.node_ids == {"n1", "n2"}, EVENT_S)
            own_etcd.stop()
            await second.stop()  # cannot revoke: returns anyway (the lease would expire on its own)
            assert second.lease_id is None
        finally:
            await registration.stop()
            await membership.close()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EtcdProcess]]:
    """A three-member etcd on loopback, for this module."""
    root = tmp_path_factory.mktemp("etcd3")
    members = [EtcdProcess(root / f"m{i}", name=f"m{i}") for i in range(3)]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.initial_cluster = initial
        m.launch()
    try:
        for m in members:
            m.wait_ready()
        yield members
    finally:
        for m in members:
            m.stop()


def test_f15_a_member_lost_from_three_is_ridden_through(etcd_cluster: list[EtcdProcess], tmp_path: Path) -> None:
    fleet = FleetSettings(etcd=",".join(m.endpoint for m in etcd_cluster), cluster="three", lease_ttl_s=2)

    async def scenario() -> None:
        first = await join(fleet, record("n1"))
        membership = await watch(fleet)
        probe_session = session_for(fleet)
        try:
            assert first.session.endpoint.port == membership.session.endpoint.port == etcd_cluster[0].client_port
            etcd_cluster[0].stop()  # the member both talk to
            # A node joining now reaches a live member through the list of endpoints (retrying, as its
            # supervisor would, while the survivors elect a leader: etcd answers UNAVAILABLE meanwhile)...
            second = await join_retrying(fleet, record("n2", 50052))
            # ...and the view, once it has moved to one, sees it.
            await membership.wait_until(lambda m: not m.stale and m.node_ids == {"n1", "n2"}, FAILOVER_S)
            # n1 renews through another member: it outlives a 2 s probe lease granted now, never renewed.
            probe = await probe_session.call(lambda c: c.lease(2))
            await probe_session.call(lambda c: c.put(node_key(fleet.cluster, "probe"), record("probe").to_json(),
                                                     lease=probe))
            await membership.wait_until(lambda m: "probe" in m.nodes, EVENT_S)
            await membership.wait_until(lambda m: "probe" not in m.nodes, EVENT_S)
            nodes, _ = await read_nodes(probe_session, fleet.cluster)
            assert {n.record.node_id for n in nodes} == {"n1", "n2"} and first.registrations == 1
            await second.stop()
        finally:
            await first.stop()
            await membership.close()
            await probe_session.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("said", ["context deadline exceeded", "etcdserver: request timed out",
                                  "etcdserver: leader changed", "etcdserver: no leader"])
def test_f15_what_etcd_says_while_it_elects_a_leader_is_unavailable_and_retried(said: str) -> None:
    """F15: a member that answers while the cluster elects a leader (or a request outlived its deadline there)
    refuses a call that will succeed again soon: UNAVAILABLE, which callers retry (the member-loss test above
    met 'context deadline exceeded' as INTERNAL, not retried, under load); any other failure stays INTERNAL."""
    import aetcd

    from kvstore.errors import Internal
    from kvstore.fleet.endpoints import Endpoint
    from kvstore.fleet.etcd import translate

    where = [Endpoint(host="127.0.0.1", port=2379)]
    error = translate(aetcd.ClientError(said), where)
    assert isinstance(error, Unavailable) and error.retryable and said in error.message
    assert isinstance(translate(aetcd.ClientError("mvcc: something else"), where), Internal)
