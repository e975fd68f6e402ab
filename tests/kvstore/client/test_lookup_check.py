"""A Lookup's hashes checked while its call flies (`Client.lookup_hashes`, docs/FLEET.md F83 on one node): a real
server on loopback."""

from __future__ import annotations

import os
import time

import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument

BLOCKS = 12


@pytest.fixture(autouse=True)
def overlapped(client: Client) -> None:
    """The check while the call flies, whatever this host's CPUs (`Client.overlap_check`'s default)."""
    client.overlap_check = True


def stored(client: Client) -> list[bytes]:
    """The chain of a prompt of BLOCKS blocks put on the server."""
    tokens = [int.from_bytes(os.urandom(2), "little") for _ in range(client.block_tokens * BLOCKS)]
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(BLOCKS)])
    return client.hashes(tokens)


def lookups(client: Client) -> int:
    """Lookups the server has answered."""
    return int(client.stats().lookups)


def test_f83_a_bad_hash_is_refused_once_the_call_answered_and_its_lease_is_released(client: Client) -> None:
    """A 33-byte hash then a 31-byte one (the packed bytes still a whole number of hashes, so the server finds and
    leases the five blocks before them) is refused by the check that ran while the call flew: the server answered
    the call, the error names the first bad hash, and the lease it granted is released."""
    chain = stored(client)
    bad = list(chain)
    bad[5], bad[6] = bad[5] + b"x", bad[6][:31]
    before = lookups(client)
    with pytest.raises(InvalidArgument, match=r"hashes\[5\] is 33 bytes"):
        client.lookup_hashes(bad, lease_ms=60_000)
    assert lookups(client) > before  # the call went out before the check refused
    assert client.stats().active_leases == 0
    found = client.lookup_hashes(chain, lease_ms=60_000)
    assert found.found_blocks == BLOCKS and client.stats().active_leases == 1
    assert found.lease_id is not None and client.release(found.lease_id)


@pytest.mark.parametrize("why", ["a pin", "overlap_check off"])
def test_f83_with_a_pin_or_the_overlap_off_the_hashes_are_checked_before_the_call(client: Client, why: str) -> None:
    """A pin outlives its call (R22), so a Lookup that pins checks its hashes first, as every Lookup does with
    `overlap_check` off: a bad one is refused and the server never sees the call (whose packed bytes would be a
    whole number of hashes, as above)."""
    bad = list(stored(client))
    bad[3], bad[4] = bad[3] + b"x", bad[4][:31]
    client.overlap_check = why != "overlap_check off"
    before = lookups(client)
    with pytest.raises(InvalidArgument, match=r"hashes\[3\] is 33 bytes"):
        client.lookup_hashes(bad, keep_until_s=time.time() + 3600 if why == "a pin" else 0.0)
    assert lookups(client) == before


def test_f83_an_item_the_request_cannot_hold_is_named_as_the_bad_hash_it_is(client: Client) -> None:
    """An int among the hashes breaks the request's packing before the check has run: the Lookup raises the
    check's InvalidArgument naming it, not the TypeError."""
    bad: list[object] = list(stored(client))
    bad[7] = 7
    with pytest.raises(InvalidArgument, match=r"hashes\[7\] is a int"):
        client.lookup_hashes(bad, lease_ms=60_000)  # type: ignore[arg-type]
    assert client.stats().active_leases == 0


def test_f83_hashes_given_as_bytearrays_are_found_with_one_lease(client: Client) -> None:
    """Hashes that are not all `bytes` are accepted as before: the call's lease is released once the check says
    so, and the Lookup asked again as bytes; one lease held, the result's hashes bytes."""
    chain = stored(client)
    mixed: list[object] = [bytearray(h) if i % 2 else h for i, h in enumerate(chain)]
    found = client.lookup_hashes(mixed, lease_ms=60_000)  # type: ignore[arg-type]
    assert found.found_blocks == BLOCKS and found.block_hashes == chain
    assert all(type(h) is bytes for h in found.block_hashes)
    assert client.stats().active_leases == 1
    assert found.lease_id is not None and client.release(found.lease_id)
