"""The leased round asks the fewest nodes that hold every run (docs/FLEET.md F82): real etcd, real nodes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client.fleet import FleetClient
from tests.kvstore.client.test_fleet import (  # noqa: F401  (fleet: the module's fixture, three nodes)
    RUN_TOKENS,
    Fleet,
    _start_node,
    blocks_for,
    calls_by_node,
    fleet,
    fleet_client,
    leased_round,
    prompt,
    purge_from,
    started_fleet,
)

RUNS = 20


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet of two nodes: at replication 2 every run is on both."""
    with started_fleet(tmp_path_factory.mktemp("two-nodes"), 2) as two:
        yield two


def first_readers(client: FleetClient, chain: list[bytes]) -> Counter[str]:
    """How many runs of `chain` read each node first (F33's order)."""
    return Counter(client.pool.read_order(chain[run.first_block], run.replicas)[0] for run in client.placement(chain))


def split_prompt(client: FleetClient) -> tuple[list[int], list[bytes], str]:
    """A prompt whose runs are read first from both nodes, run 0 from the node fewer runs read first (a draw of
    this client's, about one prompt in two); its tokens, chain and the node most runs read first."""
    for _ in range(200):
        tokens = prompt(RUN_TOKENS * RUNS)
        chain = client.hashes(tokens)
        first = first_readers(client, chain)
        run = client.placement(chain)[0]
        most, fewer = (first.most_common() + [("", 0)] * 2)[:2]
        if fewer[1] and most[1] > fewer[1] and client.pool.read_order(chain[0], run.replicas)[0] == fewer[0]:
            return tokens, chain, most[0]
    raise AssertionError("no prompt of 200 split its runs' first readers so")


def test_f82_at_replication_2_over_2_nodes_a_leased_lookup_is_one_call(two_nodes: Fleet) -> None:
    """F82: every run is on both nodes, so the leased round asks one node every run, in one call with one lease,
    where the first readers (both nodes) took a call each; the node asked is the one most runs read first (this
    client's draw, so readers spread), not run 0's; a run short there is asked of both copies by its hashes and
    the prefix goes on."""
    with fleet_client(two_nodes, replication=2) as client:
        tokens, chain, most = split_prompt(client)
        client.put(tokens, blocks_for(client, tokens))
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == len(chain) and by_node == {most: 1}
        assert found.nodes_asked == {most}
        assert {k: s.active_leases for k, s in client.node_stats().items() if s.active_leases} == {most: 1}
        assert client.release(found.lease_id)
        run = client.placement(chain)[7]
        purge_from(two_nodes.node(most), chain[run.first_block + 2])
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == len(chain) and sum(by_node.values()) == 1 + 2  # the round, run 7 of both
        assert client.release(found.lease_id)
        assert sum(s.active_leases for s in client.node_stats().values()) == 0


def test_f82_a_leased_lookup_asks_the_fewest_nodes_and_a_suspect_only_where_every_copy_is(
        fleet: Fleet) -> None:  # noqa: F811
    """F82 over three nodes at replication 2: the round asks two nodes (the runs' three pairs of copies are covered
    by two), not three; once the node holding the most runs just failed a call (F33: read last), it is asked of no
    run, since every run has a copy ranked above it."""
    with fleet_client(fleet, replication=2) as client:
        tokens = prompt(RUN_TOKENS * 30)
        client.put(tokens, blocks_for(client, tokens))
        chain = client.hashes(tokens)
        assert len(first_readers(client, chain)) == 3
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == len(chain) and set(by_node.values()) == {1} and len(by_node) == 2
        assert client.release(found.lease_id)
        held = Counter(node for run in client.placement(chain) for node in run.replicas)
        busiest = held.most_common(1)[0][0]
        client.pool.failed(busiest)
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == len(chain) and busiest not in by_node and len(by_node) == 2
        assert set(leased_round(client, chain).values()) == set(by_node)
        assert client.release(found.lease_id)


def test_f82_a_cover_is_made_again_once_the_view_changes(two_nodes: Fleet, tmp_path: Path) -> None:
    """F82: a prompt asked again is covered as before only under the same view (the cover is remembered): once a
    third node joins, each run is asked of one of its replicas now, and the Lookup finds it all. Last in the
    module: the fleet keeps three nodes."""
    with fleet_client(two_nodes, replication=2) as client:
        tokens = prompt(RUN_TOKENS * RUNS)
        client.put(tokens, blocks_for(client, tokens))
        chain = client.hashes(tokens)
        before = client.lookup_hashes(chain, lease_ms=60_000)
        assert before.found_blocks == len(chain) and len(before.nodes_asked) == 1 and before.lease_id is not None
        assert client.release(before.lease_id)
        etcd, cluster = two_nodes.address.removeprefix("etcd://").rsplit("/", 1)
        joined = _start_node(tmp_path, etcd, cluster, 2)
        try:
            client.view.wait_until(lambda nodes: joined.node_id in nodes, 30.0)
            runs = client.placement(chain)
            asked = leased_round(client, chain)
            assert all(node in runs[i].replicas for i, node in asked.items())
            assert any(node not in run.replicas for node in before.nodes_asked for run in runs)  # it moved
            found = client.lookup_hashes(chain, lease_ms=60_000)
            assert found.found_blocks == len(chain) and found.lease_id is not None
            assert client.release(found.lease_id)
        finally:
            joined.child.kill_if_alive()
