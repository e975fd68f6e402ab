"""KV cache events from a real tier (docs/EVENTS.md E1-E7): real LMDB, real ZMQ sockets, vLLM's decoder.

Every test's consumer is tests/events_consumer.py: a SUB socket and the replay socket, each
batch decoded by vLLM's own `KVEventBatch` decoder (and kvstore's, for the tenant and geometry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'kvstore[events]')")
pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'kvstore[events]')")

from kvstore.clock import ManualClock
from kvstore.config import EventsSettings, StoreSettings
from kvstore.errors import ConfigError, ResourceExhausted
from kvstore.events import wire
from kvstore.events.publisher import EventPublisher
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from tests.events_consumer import Consumer
from tests.tiers.conftest import HOUR, KIT_BLOCK, KIT_TOKENS, Kit
from tiers.events import EVENTS_DB, tenant_topic
from tiers.lmdb_tier import LmdbBlockTier

GEOMETRY = V4_1_FLASH.fingerprint.hex()
EVENTS = EventsSettings(enabled=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")


@pytest.fixture
def evented(open_tier: Callable[..., LmdbBlockTier], tmp_path: Path) -> Iterator[Callable[..., Kit]]:
    """`evented(blocks, **events)`: a Kit on the store in tmp_path, publishing events (again: a restart)."""
    def _open(blocks: int = 10, **events: object) -> Kit:
        tier = open_tier(StoreSettings(data_dir=tmp_path / "store", capacity_bytes=blocks * KIT_BLOCK,
                                       block_tokens=KIT_TOKENS))
        tier.publish_events(EventsSettings(**{**EVENTS.__dict__, **events}), "node-1")  # type: ignore[arg-type]
        return Kit(tier)

    yield _open


@pytest.fixture
def consumers() -> Iterator[Callable[..., Consumer]]:
    made: list[Consumer] = []

    def _make(kit: Kit, *topics: bytes) -> Consumer:
        pub = kit.tier.publisher
        assert pub is not None
        c = Consumer(pub.endpoint, pub.replay_endpoint, topics or (b"",))
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


def _last(kit: Kit) -> int:
    assert kit.tier.events is not None
    return kit.tier.events.next_seq() - 1


def _stored_hashes(kit: Kit, hashes: list[bytes]) -> set[bytes]:
    return {h for h, s in zip(hashes, kit.stored(hashes), strict=True) if s}


def test_e1_the_consumer_sees_every_stored_and_removed_block(evented: Callable[..., Kit], clock: ManualClock,
                                                              consumers: Callable[..., Consumer]) -> None:
    kit = evented(10)
    c = consumers(kit)
    old = kit.chain(0, 6)
    kit.put(old)
    clock.advance(100 * HOUR)  # past retention: the next Put evicts
    new = kit.chain(9000, 8)
    kit.put(new, 0, 5)
    kit.put(new, 5)  # extends a stored chain: its first event's parent is new[4]
    kit.tier.purge(kit.scope, [new[6]])  # R20: new[6] and new[7]
    c.catch_up(_last(kit))
    assert c.stored("default", GEOMETRY) == _stored_hashes(kit, old + new)
    assert _stored_hashes(kit, old) != set(old) and c.stored("default", GEOMETRY) >= set(new[:6])
    stored = [e for _, v, _ in c.batches.values() for e in v.events if type(e).__name__ == "BlockStored"]
    removed = [e for _, v, _ in c.batches.values() for e in v.events if type(e).__name__ == "BlockRemoved"]
    # What vLLM's own decoder reads: kvstore's 32-byte chain hashes, the parent, the block size, the medium.
    assert [e.block_hashes for e in stored] == [old, new[:5], new[5:]]
    assert [e.parent_block_hash for e in stored] == [None, None, new[4]]
    assert {(e.block_size, e.medium, tuple(e.token_ids)) for e in stored} == {(KIT_TOKENS, "kvstore", ())}
    assert {e.medium for e in removed} == {"kvstore"}
    assert sum(len(e.block_hashes) for e in removed) == len(old) + 2 - len(_stored_hashes(kit, old))
    assert c.batches[0][1].events[0].__class__.__name__ == "AllBlocksCleared"  # E5


def test_e1_a_refused_put_and_a_refresh_make_no_event(evented: Callable[..., Kit], clock: ManualClock) -> None:
    kit = evented(4)
    a = kit.chain(0, 4)
    kit.put(a)
    before = _last(kit)
    with pytest.raises(ResourceExhausted):
        kit.put(kit.chain(9000, 2))  # full, nothing past retention: refused, nothing stored
    clock.advance(HOUR)
    kit.tier.touch(kit.keys(a))  # a use is no event: the blocks stay where they were
    kit.put(a)  # all four exist: touched, none written
    assert _last(kit) == before


def test_e1_a_corrupt_block_dropped_on_read_is_removed(evented: Callable[..., Kit],
                                                        consumers: Callable[..., Consumer]) -> None:
    kit = evented(10)
    c = consumers(kit)
    a = kit.chain(0, 3)
    kit.put(a)
    kit.tier.drop_corrupt([kit.scope.key(a[1])])  # R10: the block and every one below it
    c.catch_up(_last(kit))
    assert c.stored("default", GEOMETRY) == {a[0]}


def test_e2_a_batch_is_one_tenants_on_its_own_topic(evented: Callable[..., Kit],
                                                     consumers: Callable[..., Consumer]) -> None:
    kit = evented(40)
    only_a = consumers(kit, tenant_topic("kv-events", "a"), tenant_topic("kv-events", None))
    everyone = consumers(kit)
    scopes = {name: BlockScope(V4_1_FLASH.fingerprint, name) for name in ("a", "a/b", "b")}
    for i, scope in enumerate(scopes.values()):
        hashes = kit.chain(100 * i, 3)
        kit.tier.put(scope, kit.root, hashes, [kit.data(j) for j in range(3)], True)
    everyone.catch_up(_last(kit))
    only_a.poll(200)  # live, through the SUB filter (a slow joiner may miss the first batches)
    only_a.replay(only_a.last_seq + 1)  # and the rest by replay, as a router does
    for topic, _, ours in everyone.batches.values():
        tenants = {e.kvstore_tenant for e in ours.events if not isinstance(e, wire.AllBlocksCleared)}
        assert len(tenants) <= 1 and topic == tenant_topic("kv-events", tenants.pop() if tenants else None)
    assert set(only_a.view) == {("a", GEOMETRY)}  # never "a/b"'s, whose topic starts "kv-events/a%2Fb/"
    assert {k[0] for k in everyone.view} == {"a", "a/b", "b"}


def test_e3_numbers_go_on_across_a_restart_and_the_log_answers_replays(
        evented: Callable[..., Kit], consumers: Callable[..., Consumer]) -> None:
    kit = evented(20)
    a = kit.chain(0, 4)
    kit.put(a, 0, 2)
    kit.put(a, 2)
    last = _last(kit)
    kit.tier.close()
    kit = evented(20)  # the same store, reopened: a restart
    c = consumers(kit)
    assert _last(kit) == last
    c.replay(0)
    assert c.last_seq == last and c.stored("default", GEOMETRY) == set(a)
    b = kit.chain(500, 2)
    kit.put(b)
    c.catch_up(last + 1)
    assert c.stored("default", GEOMETRY) == set(a) | set(b) and c.clears == 1  # one log: one AllBlocksCleared


def test_e4_a_consumer_that_missed_batches_replays_them(evented: Callable[..., Kit],
                                                         consumers: Callable[..., Consumer]) -> None:
    kit = evented(40)
    chains = [kit.chain(100 * i, 2) for i in range(5)]
    kit.put(chains[0])
    kit.put(chains[1])
    c = consumers(kit)  # subscribes late: batches 0-2 were sent before it listened
    for chain in chains[2:]:
        kit.put(chain)
    c.catch_up(_last(kit))
    assert c.replays >= 1 and sorted(c.batches) == list(range(_last(kit) + 1))
    assert c.stored("default", GEOMETRY) == {h for chain in chains for h in chain}


def test_e4_the_log_keeps_the_newest_batches(evented: Callable[..., Kit], consumers: Callable[..., Consumer]) -> None:
    kit = evented(40, replay_batches=3)
    for i in range(6):
        kit.put(kit.chain(100 * i, 1))
    c = consumers(kit)
    c.replay(0)
    assert sorted(c.batches) == [4, 5, 6]


def test_e5_a_fresh_log_starts_with_all_blocks_cleared(evented: Callable[..., Kit],
                                                        consumers: Callable[..., Consumer]) -> None:
    kit = evented(10)
    c = consumers(kit)
    c.replay(0)
    (topic, theirs, ours), = c.batches.values()
    assert topic == b"kv-events/*/" and type(theirs.events[0]).__name__ == "AllBlocksCleared"
    assert ours.events == [wire.AllBlocksCleared(kvstore_node="node-1")]


def test_e6_a_full_queue_drops_from_the_live_stream_not_from_the_log(evented: Callable[..., Kit]) -> None:
    kit = evented(40, queue_batches=2)
    assert kit.tier.events is not None
    held, reached = threading.Event(), threading.Event()
    log = kit.tier.events

    def stalled_replay(start: int) -> Iterator[object]:
        reached.set()
        held.wait(30)  # the publisher's thread is busy here while the Puts commit
        yield from log.read_from(start)

    pub = EventPublisher(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", replay=stalled_replay,
                         queue_batches=2, hwm=1000, replay_max=100)  # type: ignore[arg-type]
    old = kit.tier.publisher
    assert old is not None
    old.close()
    kit.tier.publisher = pub
    c = Consumer(pub.endpoint, pub.replay_endpoint)
    try:
        import zmq
        req = c.ctx.socket(zmq.DEALER)
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        assert reached.wait(30)
        for i in range(5):
            kit.put(kit.chain(100 * i, 1))  # returns at once: the queue never blocks a Put
        assert pub.stats.dropped_batches == 3
        held.set()
        c.catch_up(_last(kit))  # the dropped three come by replay
        assert sorted(s for s in c.batches if s > 0) == list(range(1, _last(kit) + 1))
        req.close(linger=0)
    finally:
        held.set()
        c.close()


def test_e7_sockets_beyond_loopback_are_refused_unless_insecure() -> None:
    from gateway.events import check_events_bind

    wide = EventsSettings(enabled=True, endpoint="tcp://0.0.0.0:5557")
    with pytest.raises(ConfigError, match=r"events\.endpoint"):
        check_events_bind(wide, insecure=False)
    check_events_bind(EventsSettings(enabled=True, endpoint="tcp://0.0.0.0:5557", insecure=True), insecure=False)
    check_events_bind(wide, insecure=True)  # auth.insecure
    check_events_bind(EventsSettings(enabled=True), insecure=False)


def test_events_are_off_by_default_and_leave_the_store_as_it_was(kit: Kit) -> None:
    assert EventsSettings().enabled is False
    kit.put(kit.chain(0, 2))
    assert kit.tier.events is None and kit.tier.publisher is None
    with kit.tier.env.begin() as txn:
        assert txn.get(EVENTS_DB) is None  # no events database in the store's main tree
