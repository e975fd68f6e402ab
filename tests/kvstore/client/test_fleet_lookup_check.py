"""A fleet Lookup's hashes checked while its first round's calls fly (docs/FLEET.md F83): real etcd, real nodes."""

from __future__ import annotations

import pytest

from kvstore.client import arguments
from kvstore.client.fleet import FleetClient
from kvstore.errors import InvalidArgument
from tests.kvstore.client.test_fleet import (  # noqa: F401  (fleet: the module's fixture, three nodes)
    RUN_BLOCKS,
    RUN_TOKENS,
    Fleet,
    blocks_for,
    fleet,
    fleet_client,
    lookups_by_node,
    prompt,
)

RUNS = 6


def stored_chain(client: FleetClient) -> list[bytes]:
    """The chain of a prompt of RUNS runs put through the fleet."""
    tokens = prompt(RUN_TOKENS * RUNS)
    client.put(tokens, blocks_for(client, tokens))
    return client.hashes(tokens)


def leases_held(client: FleetClient) -> int:
    """Leases held on every node now."""
    return sum(s.active_leases for s in client.node_stats().values())


def lookups(client: FleetClient) -> int:
    """Lookup calls the nodes have answered so far."""
    assert client.refresher.flush(30.0)
    return sum(lookups_by_node(client).values())


def test_f83_a_bad_hash_is_refused_after_the_first_rounds_calls_and_what_they_leased_is_released(
        fleet: Fleet) -> None:  # noqa: F811
    """F83: a hash of the wrong size inside run 1 (neither its first block, which places it, nor its last, which
    names it in the round) is found by the check while the leased round's calls fly: the calls went out (the nodes
    answered them), the error names the hash as the check always did, and no lease is left on any node. Not
    leased, the probe's call goes out the same way."""
    with fleet_client(fleet) as client:
        chain = stored_chain(client)
        bad = list(chain)
        bad[RUN_BLOCKS + 1] = bad[RUN_BLOCKS + 1][:31]
        for lease_ms in (60_000, 0):
            before = lookups(client)
            with pytest.raises(InvalidArgument, match=rf"hashes\[{RUN_BLOCKS + 1}\] is 31 bytes"):
                client.lookup_hashes(bad, lease_ms=lease_ms)
            assert lookups(client) > before  # the round was sent before the check refused
            assert leases_held(client) == 0
        found = client.lookup_hashes(chain, lease_ms=60_000)  # the good chain is found whole, as before
        assert found.found_blocks == len(chain) and leases_held(client) > 0
        assert found.lease_id is not None and client.release(found.lease_id) and leases_held(client) == 0


@pytest.mark.parametrize("where", ["run key", "run anchor"])
def test_f83_an_item_that_breaks_placement_or_a_request_is_named_as_the_bad_hash_it_is(
        fleet: Fleet, where: str) -> None:  # noqa: F811
    """F83: an int where the placement reads a run's key (its first block), or where the round names a run (its
    last block, joined into the request), breaks that code before the check has run; the Lookup still raises the
    check's InvalidArgument naming the item, not the TypeError it caused, and holds no lease."""
    with fleet_client(fleet) as client:
        chain: list[object] = list(stored_chain(client))
        at = 0 if where == "run key" else 2 * RUN_BLOCKS - 1
        chain[at] = 7
        with pytest.raises(InvalidArgument, match=rf"hashes\[{at}\] is a int"):
            client.lookup_hashes(chain, lease_ms=60_000)  # type: ignore[arg-type]
        assert leases_held(client) == 0


def test_f83_hashes_given_as_bytearrays_and_memoryviews_are_found_with_one_lease_a_node(fleet: Fleet) -> None:  # noqa: F811
    """F83: hashes that are not all `bytes` are accepted as before (as bytes); the round asked with them is
    released once the check says so, and the Lookup asked again with bytes: the prefix found whole, one lease on
    each node asked (none of the first round's left), all dropped by the release."""
    with fleet_client(fleet) as client:
        chain = stored_chain(client)
        mixed: list[object] = list(chain)
        mixed[1], mixed[RUN_BLOCKS - 1] = bytearray(chain[1]), memoryview(chain[RUN_BLOCKS - 1])
        found = client.lookup_hashes(mixed, lease_ms=60_000)  # type: ignore[arg-type]
        assert found.found_blocks == len(chain) and found.block_hashes == chain
        assert all(type(h) is bytes for h in found.block_hashes)
        held = {k: s.active_leases for k, s in client.node_stats().items() if s.active_leases}
        assert set(held) == found.nodes_asked and set(held.values()) == {1}
        assert found.lease_id is not None and client.release(found.lease_id) and leases_held(client) == 0


def test_f83_a_lookup_of_tokens_does_not_check_the_chain_it_made(fleet: Fleet,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain a fleet client hashes from a prompt's tokens is every item a hash: `lookup` asks with it unchecked
    (as one node's client does), where `lookup_hashes` checks the caller's hashes."""
    checked: list[int] = []  # the lengths of the chains checked (an empty list of SWA keys left out)
    check = arguments.exact_hashes

    def counted(values: list[object], name: str) -> None:
        if values:
            checked.append(len(values))
        check(values, name)

    monkeypatch.setattr(arguments, "exact_hashes", counted)
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * RUNS)
        client.put(tokens, blocks_for(client, tokens))
        assert client.lookup(tokens).found_blocks == RUNS * RUN_BLOCKS and checked == []
        assert client.lookup_hashes(client.hashes(tokens)).found_blocks == RUNS * RUN_BLOCKS
        assert checked == [RUNS * RUN_BLOCKS]
