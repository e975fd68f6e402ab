"""A next turn's Lookup names the chain found before and sends only its new hashes (gateway.lookup_anchors,
rules A1-A5; kvstore.client.lookup_anchors): the same answers as the whole chain, never another chain."""

from __future__ import annotations

import os
from typing import Any

import grpc
import pytest

from gateway.lookup_anchors import LookupAnchors
from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

STORED = 100  # blocks of the stored conversation: over the 64 a chain needs to be remembered


def stub_of(server: Any) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(server.target))


@pytest.fixture
def conversation(client: Client) -> tuple[list[int], list[bytes]]:
    """A stored 100-block prompt and the hashes of it plus 20 more blocks (the next turn, not stored)."""
    bt = client.block_tokens
    tokens = list(range(bt * (STORED + 20)))
    client.put(tokens[:bt * STORED], [os.urandom(client.block_bytes) for _ in range(STORED)])
    return tokens, client.hashes(tokens)


def anchored(hashes: list[bytes], blocks: int, **kwargs: Any) -> pb.LookupRequest:
    return pb.LookupRequest(anchor_hash=hashes[blocks - 1], anchor_blocks=blocks,
                            block_hashes_packed=b"".join(hashes[blocks:]), **kwargs)


def test_a1_a_next_turn_sends_only_its_new_hashes_and_finds_the_same(server: Any, client: Client,
                                                                      conversation: Any) -> None:
    _, hashes = conversation
    stub = stub_of(server)
    first = stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(hashes[:STORED])))
    assert first.found_blocks == STORED
    nxt = stub.Lookup(anchored(hashes, STORED))
    assert (nxt.anchor_unknown, nxt.found_blocks) == (False, STORED)
    assert stub.Lookup(anchored(hashes[:STORED], STORED)).found_blocks == STORED  # no new hashes at all


def test_a1_the_client_names_its_anchor_and_answers_as_a_whole_chain_would(server: Any, client: Client,
                                                                            conversation: Any) -> None:
    tokens, hashes = conversation
    bt = client.block_tokens
    assert client.lookup(tokens[:bt * STORED]).found_blocks == STORED
    assert client.connection.anchors.best(hashes) == STORED
    with Client(server.target, chain_memo_bytes=0) as whole:
        whole.connection.lookup_anchors = False
        for prompt in (tokens, tokens[:bt * (STORED + 3)], tokens[:bt * STORED]):
            assert client.lookup(prompt).found_blocks == whole.lookup(prompt).found_blocks == STORED


def test_a1_only_what_the_tier_found_is_remembered(server: Any, client: Client, conversation: Any) -> None:
    """Hashes a client merely sent (not stored) never become an anchor; the found prefix does."""
    _, hashes = conversation
    stub = stub_of(server)
    bogus = [os.urandom(32) for _ in range(80)]
    assert stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(bogus))).found_blocks == 0
    assert stub.Lookup(anchored(bogus, 80)).anchor_unknown
    mixed = hashes[:STORED] + bogus
    assert stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(mixed))).found_blocks == STORED
    assert stub.Lookup(anchored(mixed, STORED + 80)).anchor_unknown  # the sent chain's end: unknown
    assert stub.Lookup(anchored(mixed, STORED)).found_blocks == STORED  # the found prefix: known


def test_a2_another_tenant_or_geometry_never_uses_an_anchor(server: Any, client: Client, conversation: Any) -> None:
    _, hashes = conversation
    stub = stub_of(server)
    stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(hashes[:STORED])))
    assert stub.Lookup(anchored(hashes, STORED, namespace="tenant-b")).anchor_unknown
    other = next(name for name in ("v41-tiny-fixture", "deepseek-v4.1-flash") if name != client.geometry)
    assert stub.Lookup(anchored(hashes, STORED, geometry=other)).anchor_unknown


def test_a4_an_unknown_anchor_or_length_is_answered_so_and_the_client_sends_the_whole_chain(
        server: Any, client: Client, conversation: Any) -> None:
    tokens, hashes = conversation
    stub = stub_of(server)
    stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(hashes[:STORED])))
    wrong_length = pb.LookupRequest(anchor_hash=hashes[STORED - 1], anchor_blocks=STORED - 1,
                                    block_hashes_packed=b"".join(hashes[STORED:]))
    reply = stub.Lookup(wrong_length)
    assert reply.anchor_unknown and reply.found_blocks == 0
    with Client(server.target) as fresh:  # an anchor not stored at its depth: forgotten, then the whole chain
        fresh.connection.anchors.note(hashes[109], 110)
        assert fresh.lookup(tokens).found_blocks == STORED
        assert fresh.connection.anchors.best(hashes) == STORED  # the found chain replaced it


@pytest.mark.parametrize(("fields", "message"), [
    ({"anchor_hash": b"h" * 31, "anchor_blocks": 1}, "anchor_hash is 31 bytes"),
    ({"anchor_hash": b"h" * 32}, "anchor_blocks must be at least 1"),
    ({"anchor_hash": b"h" * 32, "anchor_blocks": 1, "block_hashes": [b"h" * 32]}, "goes with block_hashes_packed"),
])
def test_a_malformed_anchor_is_invalid(server: Any, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub_of(server).Lookup(pb.LookupRequest(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()


def test_a3_memory_is_bounded_and_a_next_turn_replaces_its_anchor() -> None:
    from gateway.lookup_anchors import BYTES_PER_HASH

    chain = [os.urandom(32) for _ in range(200)]
    table = LookupAnchors(max_bytes=200 * BYTES_PER_HASH, min_blocks=64)
    table.remember(b"s", chain[:63])
    assert len(table) == 0  # too short to be worth remembering
    table.remember(b"s", chain[:100])
    table.remember(b"s", chain[:110], replaces=chain[99])  # the next turn found more
    assert len(table) == 1 and table.expand(b"s", chain[99], 100) is None
    assert table.expand(b"s", chain[109], 110) == tuple(chain[:110])
    other = [os.urandom(32) for _ in range(100)]
    table.remember(b"s", other)  # 110 + 100 hashes pass 200: the least recent goes
    assert table.size_bytes <= 200 * BYTES_PER_HASH and table.expand(b"s", chain[109], 110) is None
    assert table.expand(b"t", other[99], 100) is None and table.expand(b"s", other[99], 100)


def test_a_next_turn_past_the_lookup_limit_is_invalid(start_server: Any, store_settings: Any) -> None:
    import dataclasses

    srv = start_server(dataclasses.replace(store_settings, max_lookup_blocks=STORED + 5))
    with Client(srv.target) as c:
        bt = c.block_tokens
        tokens = list(range(bt * STORED))
        c.put(tokens, [os.urandom(c.block_bytes) for _ in range(STORED)])
        hashes = c.hashes(tokens + list(range(bt * 6)))
        stub = stub_of(srv)
        assert stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(hashes[:STORED]))).found_blocks == STORED
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(anchored(hashes, STORED))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pass the 105" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(pb.LookupRequest(anchor_hash=hashes[STORED - 1], anchor_blocks=STORED,
                                         block_hashes_packed=b"x" * 33))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "33 bytes" in info.value.details()


def _scope(client: Client) -> Any:
    from kvstore.prefix import BlockScope

    return BlockScope(client.connection.fingerprint, "default")


def test_a5_a_next_turn_reads_its_anchor_from_the_store_and_its_new_hashes_as_a_chain(
        server: Any, client: Client, conversation: Any) -> None:
    """The anchor's record vouches for its prefix: no remembered chain is needed (a restarted server, or one
    that never saw the Lookup, answers from it), and blocks after it count only as its chain (R15)."""
    tokens, hashes = conversation
    bt = client.block_tokens
    stub = stub_of(server)
    assert stub.Lookup(anchored(hashes, STORED)).found_blocks == STORED  # no Lookup before it
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(20)], first_block=STORED)
    assert stub.Lookup(anchored(hashes, STORED)).found_blocks == STORED + 20  # the new blocks, stored since
    other = [os.urandom(32) for _ in range(3)]
    assert stub.Lookup(anchored(hashes[:STORED + 5] + other, STORED)).found_blocks == STORED + 5
    # Stored blocks that are not this chain's continuation (another prompt's, or this one's out of order)
    # are not counted after the anchor: each must name the one before it as its parent, one level down.
    shuffled = [*hashes[:STORED], hashes[STORED + 1], hashes[STORED]]
    assert stub.Lookup(anchored(shuffled, STORED)).found_blocks == STORED
    skipped = hashes[:STORED] + hashes[STORED + 1:]
    assert stub.Lookup(anchored(skipped, STORED)).found_blocks == STORED
    another = [t + 7 for t in tokens[:bt * (STORED + 1)]]  # another prompt's block at the depth that follows
    client.put(another, [os.urandom(client.block_bytes) for _ in range(STORED + 1)])
    assert stub.Lookup(anchored(hashes[:STORED] + client.hashes(another)[STORED:], STORED)).found_blocks == STORED
    assert stub.Lookup(anchored(hashes, STORED - 20)).found_blocks == STORED + 20  # any stored prefix anchors
    wrong_depth = pb.LookupRequest(anchor_hash=hashes[STORED - 1], anchor_blocks=STORED + 1,
                                   block_hashes_packed=b"".join(hashes[STORED:]))
    assert stub.Lookup(wrong_depth).anchor_unknown  # the depth is the record's, exactly
    assert client.lookup(tokens[:bt * (STORED + 20)] + [1] * bt).found_blocks == STORED + 20


@pytest.mark.parametrize("cut", [0, 40, STORED - 1])
def test_a5_blocks_evicted_between_turns_give_the_true_found_length(server: Any, client: Client,
                                                                     conversation: Any, cut: int) -> None:
    """The turn before found 100 blocks; the store lost block `cut` and every block below it (what eviction
    and purge remove, R6) before the next turn: its anchor is gone, and the answer is the `cut` left."""
    tokens, hashes = conversation
    bt = client.block_tokens
    assert client.lookup(tokens[:bt * STORED]).found_blocks == STORED
    assert client.connection.anchors.best(hashes) == STORED
    server.tier.purge(_scope(client), [hashes[cut]])
    assert client.lookup(tokens).found_blocks == cut
    assert client.lookup(tokens).found_blocks == cut  # the anchor noted from that answer (or none) holds


def test_a5_an_anchor_evicted_below_the_new_hashes_gives_the_true_found_length(server: Any, client: Client,
                                                                                conversation: Any) -> None:
    tokens, hashes = conversation
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(20)], first_block=STORED)
    assert client.lookup(tokens[:client.block_tokens * STORED]).found_blocks == STORED
    server.tier.purge(_scope(client), [hashes[STORED + 7]])  # the new part: the anchor stays
    assert client.lookup(tokens).found_blocks == STORED + 7


def test_a5_a_whole_tenant_purged_between_turns_finds_nothing_and_another_tenant_never_anchors(
        server: Any, client: Client, conversation: Any) -> None:
    tokens, hashes = conversation
    bt = client.block_tokens
    assert client.lookup(tokens[:bt * STORED]).found_blocks == STORED
    with Client(server.target, namespace="tenant-b") as other:
        other.connection.anchors.note(hashes[STORED - 1], STORED)  # the same hashes, named by another tenant
        assert other.lookup(tokens).found_blocks == 0
    server.tier.purge(_scope(client), None)
    assert client.lookup(tokens).found_blocks == 0


def test_a5_a_traced_node_records_an_anchored_turns_whole_chain(start_server: Any, store_settings: Any) -> None:
    """The trace records every Lookup's hashes: a node recording them answers a next turn from the
    remembered chain (A1) rather than the anchor's record, so the record holds the whole chain."""
    from kvstore.config import TraceSettings
    from kvstore.trace import recorded
    from tests.waiting import wait_until

    store = store_settings
    srv = start_server(store, trace=TraceSettings(enabled=True, flush_s=0, hash_bytes=32))
    with Client(srv.target) as c:
        bt = c.block_tokens
        tokens = list(range(bt * (STORED + 20)))
        c.put(tokens[:bt * STORED], [os.urandom(c.block_bytes) for _ in range(STORED)])
        assert c.lookup(tokens[:bt * STORED]).found_blocks == STORED
        assert c.connection.anchors.best(c.hashes(tokens)) == STORED  # the next turn names its anchor
        assert c.lookup(tokens).found_blocks == STORED
        hashes = c.hashes(tokens)
    wait_until(lambda: srv.trace.stats.written_records == 3, "the Put's and both Lookups' records written")
    *_, look = [r for _, _, r in recorded.records(store.data_dir / "trace")]
    assert (look["op"], look["found"]) == ("lookup", STORED)
    assert look["hashes"] == b"".join(hashes).hex()


def test_a5_an_anchored_turn_leases_and_asks_a_pin_on_its_deepest_found_block(server: Any, client: Client,
                                                                             conversation: Any, clock: Any) -> None:
    """A lease and a pin asked by a next turn go to its deepest found block, as a whole chain's would (this
    tenant may not pin: the answer says so, for the block found, not "nothing was found")."""
    tokens, hashes = conversation
    bt = client.block_tokens
    assert client.lookup(tokens[:bt * STORED]).found_blocks == STORED
    leased = client.lookup(tokens, lease_ms=60_000)
    assert leased.found_blocks == STORED and leased.lease_id and client.release(leased.lease_id)
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(20)], first_block=STORED)
    assert client.connection.anchors.best(hashes) == STORED  # the next call names the 100-block anchor
    kept = client.pin(tokens, clock.now() + 200 * 3600.0)
    assert kept.found_blocks == STORED + 20 and "may not pin" in kept.keep_note
    bogus = pb.LookupRequest(anchor_hash=hashes[STORED - 1], anchor_blocks=STORED, lease_ms=60_000,
                             block_hashes_packed=os.urandom(32))
    reply = stub_of(server).Lookup(bogus)
    assert reply.found_blocks == STORED and reply.lease_id  # the anchor itself is the deepest found
    assert client.release(reply.lease_id)
