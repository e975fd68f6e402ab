"""R17 (usage per namespace) and R18 (retention per namespace) on a real LMDB tier.

Time moves on a ManualClock; nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lmdb
import pytest

from kvstore.clock import ManualClock
from kvstore.errors import ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from tiers import eviction, purge
from tiers.lmdb_tier import PutBatch
from tiers.namespaces import NAMESPACE_PREFIX

HOUR = 3600.0
Kit = Any  # tests/tiers/conftest.py
RETENTION_H = {"long": 200.0, "low": 10.0}


def scope(namespace: str) -> BlockScope:
    return BlockScope(V4_1_FLASH.fingerprint, namespace)


def put(kit: Kit, namespace: str, hashes: list[bytes], **kwargs: Any) -> None:
    kit.tier.put(scope(namespace), kit.root, hashes, [kit.data(i) for i in range(len(hashes))], True, **kwargs)


def stored(kit: Kit, namespace: str, hashes: list[bytes]) -> int:
    return kit.tier.lookup(scope(namespace), hashes)[0]


def provider(namespace: str) -> float:
    return RETENTION_H.get(namespace, 72.0) * HOUR


# -- R17: usage per namespace ------------------------------------------------------------


def test_r17_usage_per_namespace_follows_puts_and_evictions(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(10)
    a, b = kit.chain(0, 3), kit.chain(1000, 2)
    put(kit, "alice", a)
    clock.advance(1)
    put(kit, "bob", b)
    clock.advance(2 * HOUR - 1)
    alice = kit.tier.namespace_usage("alice")
    assert (alice.blocks, alice.stored_bytes) == (3, 3 * kit.block_bytes)
    assert alice.token_hours == pytest.approx(3 * 16 * 2)  # 3 blocks of 16 tokens for 2 hours
    assert kit.tier.namespace_usage("bob").token_hours == pytest.approx(2 * 16 * (2 - 1 / HOUR))
    assert kit.tier.namespace_usage("nobody") == kit.tier.namespace_usage("nobody").__class__(
        blocks=0, stored_bytes=0, token_hours=0.0)
    clock.advance(100 * HOUR)
    put(kit, "carol", kit.chain(2000, 8))  # 5 free: 3 of the old blocks go, alice's first (least recently used)
    after = [kit.tier.namespace_usage(n) for n in ("alice", "bob", "carol")]
    assert [u.blocks for u in after] == [0, 2, 8]
    assert sum(u.stored_bytes for u in after) == kit.tier.stats().bytes_stored
    # Token-hours are an integral: alice's stay, and grow no more.
    assert after[0].token_hours == pytest.approx(3 * 16 * 102)
    clock.advance(HOUR)
    assert kit.tier.namespace_usage("alice").token_hours == pytest.approx(3 * 16 * 102)


def test_r17_an_aborted_put_changes_no_namespace_totals(kit: Kit) -> None:
    put(kit, "alice", kit.chain(0, 2))
    before = kit.tier.namespace_usage("alice")
    doomed = [PutBatch(scope=scope("alice"), parent_hash=kit.root, hashes=kit.chain(500, 2),
                       blocks=[kit.data(0), kit.data(1)], is_root=True),
              PutBatch(scope=scope("alice"), parent_hash=b"\x09" * 32, hashes=kit.chain(99, 1),
                       blocks=[kit.data(2)], is_root=False)]  # no parent: the whole group aborts
    with pytest.raises(Exception, match="put the prefix first"):
        kit.tier.put_many(doomed)
    assert kit.tier.namespace_usage("alice") == before


def test_r17_namespace_totals_are_recounted_at_open(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit()
    put(kit, "alice", kit.chain(0, 3))
    put(kit, "bob", kit.chain(1000, 1))
    clock.advance(HOUR)
    want = [kit.tier.namespace_usage(n) for n in ("alice", "bob")]
    assert [u.token_hours for u in want] == pytest.approx([3 * 16, 16])
    kit.tier.close()
    again = make_kit()
    assert [again.tier.namespace_usage(n) for n in ("alice", "bob")] == want  # kept across a restart
    again.tier.close()
    # A store written before these totals existed (or whose records were lost): recounted at open,
    # token-hours from how long the stored blocks have been stored.
    env = lmdb.open(str(kit.tier.settings.data_dir), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"state")) as txn:
        doomed = [bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(NAMESPACE_PREFIX)]
        assert len(doomed) == 2
        for k in doomed:
            txn.delete(k)
    env.close()
    again = make_kit()
    got = [again.tier.namespace_usage(n) for n in ("alice", "bob")]
    assert [(u.blocks, u.stored_bytes) for u in got] == [(u.blocks, u.stored_bytes) for u in want]
    assert [u.token_hours for u in got] == pytest.approx([u.token_hours for u in want])


# -- R18: retention per namespace --------------------------------------------------------


def test_r18_eviction_skips_a_longer_retention_and_takes_other_namespaces_blocks(
        make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(10)
    kit.tier.set_retention_provider(provider)
    long, short = kit.chain(0, 5), kit.chain(1000, 5)
    put(kit, "long", long)  # the least recently used
    clock.advance(1)
    put(kit, "short", short)
    clock.advance(100 * HOUR)  # past 72 h, not past 200 h
    put(kit, "new", kit.chain(2000, 5))
    assert stored(kit, "long", long) == 5
    assert stored(kit, "short", short) == 0


def test_r18_when_nothing_may_go_the_put_is_refused_naming_when_room_frees(
        make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(10)
    kit.tier.set_retention_provider(provider)
    long = kit.chain(0, 10)
    put(kit, "long", long)
    clock.advance(100 * HOUR)
    with pytest.raises(ResourceExhausted, match="namespace's retention") as exc:
        put(kit, "new", kit.chain(2000, 1))
    assert "retry in 100.0 h" in exc.value.hint  # 200 h + the touch minute - 100 h
    assert stored(kit, "long", long) == 10


def test_r18_a_retention_below_the_store_s_counts_as_the_store_s(make_kit: Callable[..., Kit],
                                                                   clock: ManualClock) -> None:
    kit = make_kit(10)
    kit.tier.set_retention_provider(provider)
    low = kit.chain(0, 10)
    put(kit, "low", low)
    clock.advance(50 * HOUR)  # past its 10 h, within the store's 72 h
    with pytest.raises(ResourceExhausted) as exc:
        put(kit, "new", kit.chain(2000, 1))
    assert "retry in 22.0 h" in exc.value.hint  # the store's 72 h (+ the touch minute) - 50 h
    assert stored(kit, "low", low) == 10


def test_r18_a_failing_provider_keeps_the_blocks(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(10)

    def broken(namespace: str) -> float:
        raise RuntimeError("policy store unreachable")

    kit.tier.set_retention_provider(broken)
    put(kit, "alice", kit.chain(0, 10))
    clock.advance(100 * HOUR)
    with pytest.raises(ResourceExhausted):
        put(kit, "new", kit.chain(2000, 1))
    assert stored(kit, "alice", kit.chain(0, 10)) == 10


def test_r18_the_eviction_scan_is_bounded_and_goes_on_where_it_stopped(
        make_kit: Callable[..., Kit], clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    kit = make_kit(10)
    kit.tier.set_retention_provider(provider)
    long, short = kit.chain(0, 6), kit.chain(1000, 4)
    put(kit, "long", long)  # the 6 least recently used blocks, kept by their 200 h
    clock.advance(1)
    put(kit, "short", short)
    clock.advance(100 * HOUR)
    monkeypatch.setattr(eviction, "MAX_EVICTION_SCAN", 4)
    with pytest.raises(ResourceExhausted, match="eviction scan stopped after 4 index entries"):
        put(kit, "new", kit.chain(2000, 1))
    put(kit, "new", kit.chain(2000, 1))  # the walk starts after the 4 it skipped: the short tenant's tail goes
    assert (stored(kit, "long", long), stored(kit, "short", short)) == (6, 3)
    clock.advance(101 * HOUR)  # the long tenant's blocks pass their 200 h: they are walked again, and go first
    put(kit, "new", kit.chain(3000, 1))
    assert (stored(kit, "long", long), stored(kit, "short", short)) == (5, 3)


def test_r18_a_leased_block_ends_the_run_the_walk_skips(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(10)
    kit.tier.set_retention_provider(provider)
    a, long, b = kit.chain(0, 1), kit.chain(1000, 5), kit.chain(2000, 4)
    for namespace, hashes in (("short", a), ("long", long), ("short", b)):
        put(kit, namespace, hashes)
        clock.advance(1)
    clock.advance(100 * HOUR)
    _, lease = kit.tier.lookup(scope("short"), a, lease_s=60.0)  # pins a (R9), the least recently used
    assert lease is not None
    put(kit, "new", kit.chain(5000, 1))  # a is leased, long is kept: b's tail goes
    assert (stored(kit, "short", a), stored(kit, "short", b)) == (1, 3)
    kit.tier.leases.release(lease.lease_id)
    put(kit, "new", kit.chain(6000, 1))  # no longer leased: a is walked again, and goes first
    assert (stored(kit, "short", a), stored(kit, "short", b), stored(kit, "long", long)) == (0, 3, 5)


def test_r18_a_block_whose_child_stays_ends_the_run_the_walk_skips(make_kit: Callable[..., Kit],
                                                                   clock: ManualClock) -> None:
    kit = make_kit(10)
    kit.tier.set_retention_provider(provider)
    c, long, b = kit.chain(0, 2), kit.chain(1000, 4), kit.chain(2000, 4)
    put(kit, "short", c[:1])
    for namespace, hashes in (("long", long), ("short", b)):
        clock.advance(1)
        put(kit, namespace, hashes)
    clock.advance(1)
    kit.tier.put(scope("short"), c[0], c[1:], [kit.data(1)], False)  # c's first block has a younger child
    clock.advance(100 * HOUR)
    put(kit, "new", kit.chain(5000, 1))  # c[0]'s child stays, long is kept: b's tail goes
    assert (stored(kit, "short", c), stored(kit, "short", b)) == (2, 3)
    assert kit.tier.purge(scope("short"), c[1:]) == 1  # c[0] is a leaf now, and the least recently used
    put(kit, "new", kit.chain(6000, 2))
    assert (stored(kit, "short", c), stored(kit, "short", b), stored(kit, "long", long)) == (0, 3, 4)


# -- R19: an NVMe quota per namespace ----------------------------------------------------


def test_r19_a_put_past_the_quota_is_refused_naming_it_and_stores_nothing(kit: Kit) -> None:
    quota = 3 * kit.block_bytes
    a = kit.chain(0, 4)
    put(kit, "alice", a[:2], quota_bytes=quota)
    with pytest.raises(ResourceExhausted) as exc:
        kit.tier.put(scope("alice"), a[1], a[2:], [kit.data(2), kit.data(3)], False, quota_bytes=quota)
    assert "'alice'" in str(exc.value) and "stores 2048 bytes" in str(exc.value) and "3072 bytes" in str(exc.value)
    assert "nvme_quota_bytes" in exc.value.hint and "retry in 72.0 h" in exc.value.hint  # its blocks are fresh
    assert stored(kit, "alice", a) == 2 and kit.tier.namespace_usage("alice").blocks == 2
    assert kit.tier.stats().counters.rejected_puts == 1
    put(kit, "bob", kit.chain(1000, 4), quota_bytes=4 * kit.block_bytes)  # another namespace's own quota
    put(kit, "alice", a[:2], quota_bytes=quota)  # blocks already stored need no room


def test_r19_a_namespace_at_its_quota_makes_room_from_its_own_blocks_past_retention(
        make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(20)
    bob = kit.chain(1000, 3)
    put(kit, "bob", bob)  # the least recently used, and past retention too
    clock.advance(1)
    alice = kit.chain(0, 3)
    put(kit, "alice", alice)
    clock.advance(100 * HOUR)
    put(kit, "alice", kit.chain(5000, 2), quota_bytes=3 * kit.block_bytes)
    assert stored(kit, "alice", alice) == 1  # its own tail went (the store itself had room)
    assert stored(kit, "bob", bob) == 3
    assert kit.tier.namespace_usage("alice").stored_bytes == 3 * kit.block_bytes
    with pytest.raises(ResourceExhausted, match="over its NVMe quota"):  # 1 block of its 3 may go, 3 are needed
        put(kit, "alice", kit.chain(6000, 3), quota_bytes=3 * kit.block_bytes)
    assert stored(kit, "alice", alice) == 1


def test_r19_the_quota_walk_is_bounded_and_goes_on_where_it_stopped(
        make_kit: Callable[..., Kit], clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    kit = make_kit(20)
    bob, alice = kit.chain(1000, 4), kit.chain(0, 3)
    put(kit, "bob", bob)  # the least recently used: 4 blocks the quota walk must step over
    clock.advance(1)
    put(kit, "alice", alice)
    clock.advance(100 * HOUR)
    monkeypatch.setattr(eviction, "MAX_EVICTION_SCAN", 3)
    with pytest.raises(ResourceExhausted, match="its eviction scan stopped early"):
        put(kit, "alice", kit.chain(5000, 1), quota_bytes=3 * kit.block_bytes)
    put(kit, "alice", kit.chain(5000, 1), quota_bytes=3 * kit.block_bytes)  # starts after bob's first 3
    assert (stored(kit, "alice", alice), stored(kit, "bob", bob)) == (2, 4)


def test_r19_a_quota_provider_sets_each_namespace_s_quota(kit: Kit) -> None:
    kit.tier.set_quota_provider(lambda namespace: 2 * kit.block_bytes if namespace == "alice" else 0)
    with pytest.raises(ResourceExhausted, match="'alice' is over its NVMe quota"):
        put(kit, "alice", kit.chain(0, 3))
    put(kit, "bob", kit.chain(0, 3))  # 0: no quota
    put(kit, "alice", kit.chain(0, 3), quota_bytes=3 * kit.block_bytes)  # a batch's own quota comes first


# -- R20: purge ----------------------------------------------------------------------------


def test_r20_purge_of_a_prompt_removes_its_blocks_and_every_block_below_them(
        make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = make_kit(20)
    trunk = kit.chain(0, 5)
    branch = kit.chain(7000, 3, parent=trunk[1])
    put(kit, "alice", trunk)
    kit.tier.put(scope("alice"), trunk[1], branch, [kit.data(i) for i in range(3)], False)
    put(kit, "bob", trunk)  # the same hashes in another namespace
    _, lease = kit.tier.lookup(scope("alice"), trunk, lease_s=60.0)
    assert lease is not None  # a lease does not stop an admin's purge
    assert kit.tier.purge(scope("alice"), trunk[3:]) == 2
    assert stored(kit, "alice", trunk) == 3 and stored(kit, "alice", trunk[:2] + branch) == 5
    assert kit.tier.purge(scope("alice"), [trunk[1]]) == 5  # its branch and the rest of the trunk go with it
    assert stored(kit, "alice", trunk) == 1 and stored(kit, "alice", trunk[:2] + branch) == 1
    assert kit.tier.purge(scope("alice"), [trunk[4], b"\x07" * 32]) == 0  # gone or never stored: nothing to do
    assert stored(kit, "bob", trunk) == 5
    assert kit.tier.namespace_usage("alice").blocks == 1 and kit.tier.stats().blocks_stored == 6
    assert kit.tier.stats().counters.purged_blocks == 7
    kit.tier.close()
    again = make_kit(20)  # durable: a restart finds the same
    assert stored(again, "alice", trunk) == 1 and again.tier.stats().blocks_stored == 6


def test_r20_purge_of_a_namespace_removes_its_whole_cache_in_every_geometry(
        kit: Kit, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(purge, "PURGE_CHUNK", 2)  # several transactions, each keeping R6
    old = BlockScope(bytes.fromhex("2d76cb51b8017512"), "alice")  # blocks of an earlier codec
    trunk = kit.chain(0, 4)
    put(kit, "alice", trunk)
    kit.tier.put(old, kit.root, trunk[:2], [kit.data(0), kit.data(1)], True)
    put(kit, "bob", trunk[:3])
    clock.advance(HOUR)
    hours = kit.tier.namespace_usage("alice").token_hours
    assert kit.tier.purge(scope("alice"), None) == 6
    assert stored(kit, "alice", trunk) == 0 and kit.tier.lookup(old, trunk)[0] == 0
    assert stored(kit, "bob", trunk) == 3 and kit.tier.stats().blocks_stored == 3
    alice = kit.tier.namespace_usage("alice")
    assert (alice.blocks, alice.stored_bytes, alice.token_hours) == (0, 0, pytest.approx(hours))  # history stays
    assert kit.tier.purge(scope("alice"), None) == 0


def test_r20_each_purge_transaction_keeps_r6(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    trunk = kit.chain(0, 6)
    put(kit, "alice", trunk)
    seen: list[int] = []
    write = kit.tier._write

    def watched() -> Any:  # after each purge commit, every stored block's parent is stored
        seen.append(stored(kit, "alice", trunk))
        return write()

    monkeypatch.setattr(purge, "PURGE_CHUNK", 2)
    monkeypatch.setattr(kit.tier, "_write", watched)
    assert kit.tier.purge(scope("alice"), None) == 6
    assert seen == [6, 4, 2]  # the deepest two went in each
    assert stored(kit, "alice", trunk) == 0


def test_r20_a_block_put_below_while_a_purge_runs_goes_with_it(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    trunk = kit.chain(0, 6)
    put(kit, "alice", trunk[:5])
    listing = purge.subtree_blocks

    def then_put(*args: Any) -> list[tuple[int, bytes]]:
        listed = listing(*args)
        kit.tier.put(scope("alice"), trunk[4], trunk[5:], [kit.data(5)], False)  # after the listing
        return listed

    monkeypatch.setattr(purge, "subtree_blocks", then_put)
    assert kit.tier.purge(scope("alice"), trunk[3:4]) == 3
    found = kit.tier.read([scope("alice").key(h) for h in trunk])
    assert [s.name for s, _ in found] == ["FOUND"] * 3 + ["MISSING"] * 3  # no block left without its parent
