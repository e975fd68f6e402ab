"""A fleet Lookup's runs named by their last blocks (docs/FLEET.md F77, F78, F81): real etcd, real nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.client.fleet import FleetClient
from kvstore.client.fleet_lookup import FoundChains
from kvstore.clock import ManualClock
from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2 as pb
from tests.kvstore.client.test_fleet import (  # noqa: F401  (fleet: the module's fixture, three nodes)
    RUN_BLOCKS,
    RUN_TOKENS,
    Fleet,
    blocks_for,
    calls_by_node,
    fleet,
    fleet_client,
    leased_round,
    prompt,
    purge_from,
    second_run_stored,
    started_fleet,
)
from tiers.leases import LeaseTable

HASH_BYTES = 32


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet of one node: every run's read order is that node."""
    with started_fleet(tmp_path_factory.mktemp("one-node"), 1) as one:
        yield one


class Recorded:
    """A node stub's Lookup that records each request's run_anchors and hash bytes, then sends it on."""

    def __init__(self, call: Any, log: list[tuple[bool, int]]) -> None:
        self.call, self.log = call, log

    def __call__(self, request: pb.LookupRequest, **kwargs: Any) -> Any:
        self.log.append((request.run_anchors, len(request.block_hashes_packed)))
        return self.call(request, **kwargs)

    def future(self, request: pb.LookupRequest, **kwargs: Any) -> Any:
        sent = len(request.block_hashes_packed) or HASH_BYTES * len(request.block_hashes)
        self.log.append((request.run_anchors, sent))
        return self.call.future(request, **kwargs)


def recording(client: FleetClient) -> list[tuple[bool, int]]:
    """(run_anchors, bytes of hashes) of every Lookup the client sends a node from now on."""
    log: list[tuple[bool, int]] = []
    for node in client.view.nodes:
        c = client.pool.connection(node)
        c.kvstore.Lookup = Recorded(c.kvstore.Lookup, log)  # type: ignore[method-assign]
    return log


def test_f77_a_node_answers_each_run_named_by_its_last_block_whole_or_not(fleet: Fleet) -> None:  # noqa: F811
    """F77: a run is its length when its last hash is stored at that depth, else 0; a whole run is leased on
    that block; a count that is not one hash per run is INVALID_ARGUMENT naming it; run_anchors without
    run_lengths is a plain Lookup."""
    with fleet_client(fleet) as client:
        chain, run, node = second_run_stored(client)
        # run 1 whole; its head (block 5 at depth 2); its last block at a wrong depth; a hash stored nowhere
        anchors = [chain[7], chain[5], chain[7], bytes(32)]
        before = client.node_stats()[run.replicas[0]].active_leases
        reply = node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(anchors),
                                                                run_lengths=[4, 2, 3, 1], run_anchors=True,
                                                                lease_ms=60_000))
        assert list(reply.run_found_blocks) == [4, 2, 0, 0] and reply.found_blocks == 6
        assert [bool(lease) for lease in reply.run_lease_ids] == [True, True, False, False]
        one = reply.run_lease_ids[0]
        assert reply.run_lease_ids[1] == one  # one lease for the call's whole runs
        assert client.node_stats()[run.replicas[0]].active_leases == before + 1
        assert node.call(node.kvstore.Release, pb.ReleaseRequest(lease_id=one)).released
        assert not node.call(node.kvstore.Release, pb.ReleaseRequest(lease_id=one)).released
        with pytest.raises(InvalidArgument, match=r"one last hash each \(run_anchors\) 2 hashes sent, got 3 runs"):
            node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(chain[6:8]),
                                                            run_lengths=[2, 1, 1], run_anchors=True))
        purge_from(fleet.node(run.replicas[0]), chain[6])  # run 1 loses its last 2 blocks there
        reply = node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=chain[7] + chain[5],
                                                                run_lengths=[4, 2], run_anchors=True))
        assert list(reply.run_found_blocks) == [0, 2]


def test_f77_a_leased_lookup_names_each_run_by_its_last_hash(fleet: Fleet) -> None:  # noqa: F811
    """F77: the leased round sends one hash per run (not the run's hashes), still one call per node and a lease
    per node; a run short on the replica the round asked is asked of its copies by its hashes, the prefix goes
    on."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 30)
        client.put(tokens, blocks_for(client, tokens))
        log = recording(client)
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == 30 * RUN_BLOCKS and found.lease_id is not None
        assert set(by_node.values()) == {1}
        assert sum(s.active_leases for s in client.node_stats().values()) == len(by_node)  # one lease per node
        assert all(anchored for anchored, _ in log) and sum(n for _, n in log) == 30 * HASH_BYTES
        assert client.release(found.lease_id)
        chain = client.hashes(tokens)
        run = client.placement(chain)[12]
        purge_from(fleet.node(leased_round(client, chain)[12]), chain[run.first_block + 2])
        del log[:]
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        # run 12 by its hashes of every node of its order at once: its replicas (the one the round asked too: its
        # count is unknown) and the node ranked next (F42)
        assert found.found_blocks == 30 * RUN_BLOCKS and sum(by_node.values()) <= 3 + 3
        assert [n for anchored, n in log if not anchored] == [RUN_BLOCKS * HASH_BYTES] * 3
        assert client.release(found.lease_id)


def lookups_sent(client: FleetClient, log: list[tuple[bool, int]], lookup: Callable[[], Any]) -> tuple[Any, list]:
    del log[:]
    found, _ = calls_by_node(client, lookup)
    return found, list(log)


def test_f78_where_one_node_reads_every_run_first_the_probe_asks_it_every_run_by_its_last_block(
        one_node: Fleet) -> None:
    """F78: with one node first in every run's order, a prompt sent again is one call of one hash per run; a half
    stored one is two calls (that one, then the boundary run by its hashes), not the probe and a round of every run's
    hashes; leased, the same one call (and a half-stored prompt asked again, one call too: F81); what is found is as
    before."""
    with fleet_client(one_node) as client:
        tokens = prompt(RUN_TOKENS * 12)
        client.put(tokens, blocks_for(client, tokens))
        log = recording(client)
        found, sent = lookups_sent(client, log, lambda: client.lookup(tokens))
        assert found.found_blocks == 12 * RUN_BLOCKS and sent == [(True, 12 * HASH_BYTES)]
        found, sent = lookups_sent(client, log, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == 12 * RUN_BLOCKS and sent == [(True, 12 * HASH_BYTES)]
        assert client.release(found.lease_id)
        half = tokens[:RUN_TOKENS * 6 + 32] + prompt(RUN_TOKENS * 6 - 32)  # run 6 found 2 blocks
        found, sent = lookups_sent(client, log, lambda: client.lookup(half))
        assert found.found_blocks == 6 * RUN_BLOCKS + 2
        assert sent == [(True, 12 * HASH_BYTES), (False, RUN_BLOCKS * HASH_BYTES)]
        leased, sent = lookups_sent(client, log, lambda: client.lookup(half, lease_ms=60_000))
        # F81: the Lookup before found 26 blocks, so run 6 rides by its hashes in the one call
        assert leased.found_blocks == 6 * RUN_BLOCKS + 2 and sent == [(True, (11 + RUN_BLOCKS) * HASH_BYTES)]
        assert sum(s.active_leases for s in client.node_stats().values()) == 2  # runs 0-5 whole, run 6's 2 blocks
        assert client.release(leased.lease_id)



class Predates(Recorded):
    """A node that predates run_anchors: the field is unknown to it, so the request reaches it without."""

    def __call__(self, request: pb.LookupRequest, **kwargs: Any) -> Any:
        old = pb.LookupRequest()
        old.CopyFrom(request)
        old.run_anchors = False
        return super().__call__(old, **kwargs)


def test_f77_a_node_that_predates_run_anchors_is_asked_again_by_the_runs_hashes(fleet: Fleet) -> None:  # noqa: F811
    """F77: such a node answers INVALID_ARGUMENT (one hash a run does not sum to the lengths); its runs are asked
    again at once by their hashes, and the Lookup finds and leases as before."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 9)
        client.put(tokens, blocks_for(client, tokens))
        log: list[tuple[bool, int]] = []
        for node in client.view.nodes:
            c = client.pool.connection(node)
            c.kvstore.Lookup = Predates(c.kvstore.Lookup, log)  # type: ignore[method-assign]
        leased, _ = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))  # refreshes left out
        assert leased.found_blocks == 9 * RUN_BLOCKS and leased.lease_id is not None
        assert sum(s.active_leases for s in client.node_stats().values()) == 9  # as before: a lease per run
        assert client.release(leased.lease_id)
        assert sum(n for _, n in log) == 9 * HASH_BYTES + 9 * RUN_BLOCKS * HASH_BYTES  # by last hash, then again


def test_f77_one_lease_pins_every_key_until_released_or_expired() -> None:
    clock = ManualClock()
    table = LeaseTable(clock)
    alone = table.grant(b"b", 10.0)
    together = table.grant_together([b"a", b"b", b"c"], 5.0)
    assert together.keys == (b"a", b"b", b"c") and table.active() == 2
    assert table.pinned() == {b"a", b"b", b"c"}
    assert table.release(together.lease_id) and not table.release(together.lease_id)
    assert table.pinned() == {b"b"}  # the other lease's pin stays
    again = table.grant_together([b"a", b"c"], 5.0)
    clock.advance(6.0)
    assert table.pinned() == {b"b"} and table.active() == 1 and not table.release(again.lease_id)
    assert table.release(alone.lease_id) and table.pinned() == frozenset()


def test_f77_a_shared_lease_is_refused_as_another_tenants_by_its_first_key() -> None:
    table = LeaseTable(ManualClock())
    lease = table.grant_together([b"t1-a", b"t1-b"], 5.0)
    assert not table.release(lease.lease_id, owns=lambda key: key.startswith(b"t2"))
    assert table.release(lease.lease_id, owns=lambda key: key.startswith(b"t1")) and not table.pinned()


def test_f77_the_probe_and_f76s_round_name_runs_by_their_last_blocks(fleet: Fleet) -> None:  # noqa: F811
    """F77 without a lease: the probe sends the last run's last hash alone; after a short one, F76's round asks
    every copy by last hashes, and only the boundary run goes by its hashes (to every node of its order)."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 12)
        client.put(tokens, blocks_for(client, tokens))
        log = recording(client)
        found, sent = lookups_sent(client, log, lambda: client.lookup(tokens))
        assert found.found_blocks == 12 * RUN_BLOCKS and sent == [(True, HASH_BYTES)]
        half = tokens[:RUN_TOKENS * 6 + 16] + prompt(RUN_TOKENS * 6 - 16)  # run 6 found 1 block
        found, sent = lookups_sent(client, log, lambda: client.lookup(half))
        assert found.found_blocks == 6 * RUN_BLOCKS + 1
        assert sent[0] == (True, HASH_BYTES) and all(anchored for anchored, _ in sent[1:1 + len(fleet.nodes)])
        by_hashes = [n for anchored, n in sent if not anchored]
        assert by_hashes == [RUN_BLOCKS * HASH_BYTES] * len(by_hashes) and 1 <= len(by_hashes) <= 3  # run 6 only


class Requests:
    """A node stub's Lookup that keeps a copy of each request (with the node it went to), then sends it on."""

    def __init__(self, call: Any, node: str, log: list[tuple[str, pb.LookupRequest]], *, strip: bool = False) -> None:
        self.call, self.node, self.log, self.strip = call, node, log, strip

    def __call__(self, request: pb.LookupRequest, **kwargs: Any) -> Any:
        self.log.append((self.node, request))
        if self.strip:  # a node that predates run_hashed: the field is unknown to it
            old = pb.LookupRequest()
            old.CopyFrom(request)
            del old.run_hashed[:]
            request = old
        return self.call(request, **kwargs)

    def future(self, request: pb.LookupRequest, **kwargs: Any) -> Any:
        self.log.append((self.node, request))
        return self.call.future(request, **kwargs)


def requests_of(client: FleetClient, *, strip: bool = False) -> list[tuple[str, pb.LookupRequest]]:
    """(node, request) of every Lookup the client sends a node from now on."""
    log: list[tuple[str, pb.LookupRequest]] = []
    for node in client.view.nodes:
        c = client.pool.connection(node)
        c.kvstore.Lookup = Requests(c.kvstore.Lookup, node, log, strip=strip)  # type: ignore[method-assign]
    return log


def test_f81_a_node_counts_the_runs_flagged_run_hashed_and_names_the_rest_by_their_last_block(
        fleet: Fleet) -> None:  # noqa: F811
    """F81: in one call, runs by their last hash (whole or 0) and flagged runs by their hashes (their count); a flag
    count that is not one a run, or hashes that do not match the flags, is INVALID_ARGUMENT."""
    with fleet_client(fleet) as client:
        chain, run, node = second_run_stored(client)
        purge_from(fleet.node(run.replicas[0]), chain[6])  # run 1 keeps its first 2 blocks there
        # run 1 by its hashes; run 1's head by its last hash (whole); run 1 by its last hash (gone); a stray hash
        hashes = [*chain[4:8], chain[5], chain[7], bytes(32)]
        reply = node.call(node.kvstore.Lookup, pb.LookupRequest(
            block_hashes_packed=b"".join(hashes), run_lengths=[4, 2, 4, 1], run_anchors=True,
            run_hashed=[True, False, False, False], lease_ms=60_000))
        assert list(reply.run_found_blocks) == [2, 2, 0, 0] and reply.found_blocks == 4
        assert all(reply.run_lease_ids[:2]) and not any(reply.run_lease_ids[2:])
        for lease in set(reply.run_lease_ids[:2]):
            assert node.call(node.kvstore.Release, pb.ReleaseRequest(lease_id=lease)).released
        with pytest.raises(InvalidArgument, match="run_hashed flags runs"):
            node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(hashes), run_lengths=[4, 3],
                                                            run_anchors=True, run_hashed=[True]))
        with pytest.raises(InvalidArgument, match="some flagged run_hashed"):
            node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(hashes[:4]),
                                                            run_lengths=[4, 2], run_anchors=True,
                                                            run_hashed=[True, True]))


def test_f81_a_prompt_found_half_stored_before_is_found_in_one_round_trip(fleet: Fleet) -> None:  # noqa: F811
    """F81: once a Lookup found a prompt stored up to inside run 6, the next Lookup of it skips the probe and asks
    the runs before run 6 of the node read first and run 6 of every node of its order by its hashes, in one call per
    node: one round trip, the same found; a guess short of what is stored since finds it all (the walk asks the
    rest); once the whole prompt is stored, one round trip again (the last run found whole: F31)."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 12)
        client.put(tokens, blocks_for(client, tokens))
        half = tokens[:RUN_TOKENS * 6 + 16] + prompt(RUN_TOKENS * 6 - 16)  # run 6 found 1 block
        log = requests_of(client)
        first, _ = calls_by_node(client, lambda: client.lookup(half))
        assert first.found_blocks == 6 * RUN_BLOCKS + 1 and len(log) > len(fleet.nodes)  # the probe, the round, run 6
        del log[:]
        again, by_node = calls_by_node(client, lambda: client.lookup(half))
        assert again.found_blocks == first.found_blocks
        assert set(by_node.values()) == {1} and len(log) == len(by_node)  # one call a node: one round trip
        chain = client.hashes(half)
        run = client.placement(chain)[6]
        order = client.pool.read_order(chain[run.first_block], run.replicas)
        for node, request in log:
            assert request.run_anchors and len(request.run_hashed) in (0, len(request.run_lengths))
            flagged = [n for n, f in zip(request.run_lengths, request.run_hashed, strict=True) if f]
            assert flagged == ([RUN_BLOCKS] if node in order else [])  # run 6, on every node of its order
        assert {node for node, request in log if request.run_hashed} == set(order)
        assert sum(len(r.run_lengths) for _, r in log) == 6 + len(order) + 1  # runs 0-5 once, run 6, run 11
        more = half[:(8 * RUN_BLOCKS + 2) * 16]  # runs 6 and 7 whole, run 8's first 2 blocks
        client.put(more, blocks_for(client, more)[6 * RUN_BLOCKS + 1:], first_block=6 * RUN_BLOCKS + 1)
        client.found_chains = FoundChains()  # the Put's note forgotten: the Lookup's guess, 25 blocks, is short
        client.found_chains.found(chain, 6 * RUN_BLOCKS + 1, 0)
        stale, _ = calls_by_node(client, lambda: client.lookup(half))  # run 6 whole: the rest asked, as F76 does
        assert stale.found_blocks == 8 * RUN_BLOCKS + 2
        client.put(half, blocks_for(client, half)[8 * RUN_BLOCKS + 2:], first_block=8 * RUN_BLOCKS + 2)
        client.found_chains = FoundChains()  # the Put's note forgotten: the Lookup's guess, 34 blocks, is short
        client.found_chains.found(chain, 8 * RUN_BLOCKS + 2, 0)
        del log[:]
        whole, by_node = calls_by_node(client, lambda: client.lookup(half))
        assert whole.found_blocks == 12 * RUN_BLOCKS and set(by_node.values()) == {1}  # stored since: one round
        del log[:]
        found, sent = calls_by_node(client, lambda: client.lookup(half))  # guessed whole: the probe, one call
        assert found.found_blocks == 12 * RUN_BLOCKS and sum(sent.values()) == 1


def test_f81_a_node_that_predates_run_hashed_is_asked_again_by_the_runs_hashes(fleet: Fleet) -> None:  # noqa: F811
    """F81: a node that does not know run_hashed reads the hashes as too many for one a run and answers
    INVALID_ARGUMENT (F77's fallback): its runs are asked again by their hashes, and what is found is the same."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 9)
        client.put(tokens, blocks_for(client, tokens))
        half = tokens[:RUN_TOKENS * 4 + 32] + prompt(RUN_TOKENS * 5 - 32)  # run 4 found 2 blocks
        assert client.lookup(half).found_blocks == 4 * RUN_BLOCKS + 2
        log = requests_of(client, strip=True)
        again, _ = calls_by_node(client, lambda: client.lookup(half))
        assert again.found_blocks == 4 * RUN_BLOCKS + 2
        assert any(r.run_hashed for _, r in log) and any(not r.run_anchors for _, r in log)  # refused, asked again


def test_f81_a_gateway_guesses_for_each_caller_as_the_fleet_client_does(fleet: Fleet) -> None:  # noqa: F811
    """F81 in a gateway (`FleetStore.route_lookup`): a caller's half-stored prompt asked again is one call a node,
    its boundary run by its hashes; what is found is the same."""
    from gateway.fleet_store import FleetStore
    from gateway.routed_store import Route
    from kvstore.config_sections import FleetSettings, StoreSettings

    endpoint, cluster = fleet.address.removeprefix("etcd://").split("/")
    store = FleetStore(StoreSettings(block_tokens=16), FleetSettings(etcd=endpoint, cluster=cluster))
    try:
        with fleet_client(fleet) as client:
            tokens = prompt(RUN_TOKENS * 12)
            client.put(tokens, blocks_for(client, tokens))
            chain = client.hashes(tokens[:RUN_TOKENS * 6 + 16] + prompt(RUN_TOKENS * 6 - 16))  # run 6 found 1 block
        route = Route(token=None, namespace="", geometry="")
        store.view.wait_until(lambda nodes: len(nodes) == len(fleet.nodes), 30.0)
        pool = store._route(route)[0]
        log: list[tuple[str, pb.LookupRequest]] = []
        for node in store.view.nodes:
            c = pool.connection(node)
            c.kvstore.Lookup = Requests(c.kvstore.Lookup, node, log)  # type: ignore[method-assign]
        assert store.route_lookup(route, chain, 0)[0] == 6 * RUN_BLOCKS + 1
        first = len(log)
        del log[:]
        assert store.route_lookup(route, chain, 0)[0] == 6 * RUN_BLOCKS + 1
        assert len(log) == len({node for node, _ in log}) < first  # one call a node
        assert sum(f for _, r in log for f in r.run_hashed) == len({n for n, r in log if any(r.run_hashed)}) >= 1
    finally:
        store.close()
