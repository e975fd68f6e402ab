"""The embedded pool's shared memory: per-tenant sealed arenas, their allocator, and the reserve/commit steps
the shared-memory path uses, under the same cap, LRU and TTL as the gateway path (real memfds)."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.clock import ManualClock
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import namespace_id
from kvstore.swa_snapshot import HEADER_BYTES, seal, unseal
from tiers.swa_memory import MemoryPool, arena_id
from tiers.swa_shm import GRANULE, SEALS, Arena

MiB = 1 << 20
FP = b"f" * 8


def key(tenant: str, i: int) -> bytes:
    return FP + namespace_id(tenant) + i.to_bytes(4, "little") + bytes(28)


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena("kvstore-swa-test", 16 * GRANULE, idle_limit=4 * GRANULE)
    yield a
    a.close()


def test_an_arena_is_sealed_against_resizing(arena: Arena) -> None:
    assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    with pytest.raises(PermissionError):
        os.ftruncate(arena.fd, GRANULE)  # a client could otherwise make the server's mapping fault


def test_allocations_are_pages_and_freed_ranges_coalesce(arena: Arena) -> None:
    offsets = [arena.alloc(GRANULE + 1) for _ in range(8)]  # two granules each: the whole arena
    assert offsets == [i * 2 * GRANULE for i in range(8)]
    assert arena.alloc(1) is None  # full
    for offset in offsets[2:6]:
        arena.free(offset, GRANULE + 1)
    assert arena.alloc(8 * GRANULE) == offsets[2]  # the four freed neighbours are one range again
    arena.free(offsets[0], GRANULE + 1)
    arena.free(offsets[1], GRANULE + 1)
    assert arena.alloc(4 * GRANULE) == 0


def test_freed_pages_past_the_idle_limit_go_back_to_the_kernel(arena: Arena) -> None:
    offsets = [arena.alloc(2 * GRANULE) for _ in range(4)]
    for offset in offsets:
        assert offset is not None
        arena.write(offset, b"\xab" * 2 * GRANULE)
    for offset in offsets:
        assert offset is not None
        arena.free(offset, 2 * GRANULE)
    # The first two frees stay committed (4 granules of idle budget); the rest are punched out: zeros.
    assert arena.read(0, 4) == b"\xab" * 4 and arena.read(6 * GRANULE, 4) == bytes(4)


def test_a_read_only_descriptor_cannot_be_mapped_for_writing(arena: Arena) -> None:
    fd = arena.open_fd(writable=False)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, arena.size)
        view = mmap.mmap(fd, arena.size, prot=mmap.PROT_READ)
        arena.write(GRANULE, b"seen")
        assert view[GRANULE:GRANULE + 4] == b"seen"  # the same pages
        view.close()
    finally:
        os.close(fd)


@pytest.fixture
def pool(clock: ManualClock, loop_thread: Any) -> Iterator[MemoryPool]:
    p = MemoryPool(cap_bytes=4 * MiB, clock=clock)
    yield p
    loop_thread.run(p.close())


def test_tenants_have_their_own_arenas(pool: MemoryPool, loop_thread: Any) -> None:
    a, b = key("a", 1), key("b", 1)
    assert arena_id(a) == namespace_id("a") and arena_id(b"short") == b""
    loop_thread.run(pool.put_many([(a, b"A" * 100), (b, b"B" * 100)], 60))
    arena_a, arena_b = pool.arena(namespace_id("a")), pool.arena(namespace_id("b"))
    assert arena_a is not arena_b
    assert bytes(arena_a.view).find(b"A" * 100) >= 0 and bytes(arena_a.view).find(b"B" * 100) == -1
    assert bytes(arena_b.view).find(b"A" * 100) == -1


def test_a_committed_reservation_is_the_gateways_record_and_expires(pool: MemoryPool, clock: ManualClock,
                                                                   loop_thread: Any) -> None:
    tenant, k = namespace_id("a"), key("a", 1)
    [offset] = pool.reserve(tenant, [HEADER_BYTES + 1000])
    assert offset is not None
    pool.arena(tenant).write(offset + HEADER_BYTES, b"s" * 1000)
    assert loop_thread.run(pool.get_many([k])) == [None]  # not live before its commit
    pool.commit(tenant, [(k, offset, HEADER_BYTES + 1000, b"h" * HEADER_BYTES)], ttl_s=10)
    assert loop_thread.run(pool.get_many([k])) == [b"h" * HEADER_BYTES + b"s" * 1000]
    [located] = pool.locate([k])
    assert located is not None and located.offset == offset and located.header == b"h" * HEADER_BYTES
    clock.advance(11)
    assert pool.locate([k]) == [None] and loop_thread.run(pool.usage()).expirations == 1


def test_reservations_count_against_the_cap_and_evict_the_least_recently_used(pool: MemoryPool,
                                                                              loop_thread: Any) -> None:
    tenant = namespace_id("a")
    loop_thread.run(pool.put_many([(key("a", i), os.urandom(MiB)) for i in range(4)], 60))  # the whole cap
    pool.locate([key("a", 0)])  # recently used: kept
    offsets = pool.reserve(tenant, [MiB, MiB])
    assert None not in offsets
    got = loop_thread.run(pool.get_many([key("a", i) for i in range(4)]))
    assert got[0] is not None and sum(g is not None for g in got) == 2  # two evicted for the reservation
    usage = loop_thread.run(pool.usage())
    assert usage.evictions == 2 and usage.bytes_used == 2 * MiB
    pool.release(tenant, [(o, MiB) for o in offsets if o is not None])
    loop_thread.run(pool.put_many([(key("a", 9), os.urandom(MiB)), (key("a", 8), os.urandom(MiB))], 60))
    assert loop_thread.run(pool.usage()).evictions == 2  # the released bytes made room: nothing else evicted


def test_a_reservation_larger_than_the_pool_is_dropped(pool: MemoryPool, loop_thread: Any) -> None:
    big, small = pool.reserve(namespace_id("a"), [5 * MiB, 100])
    assert big is None and small is not None  # dropped as put_many drops it; the rest of the batch is kept
    assert loop_thread.run(pool.usage()).evictions == 1


def test_a_located_range_is_not_reused_until_unpinned(pool: MemoryPool, loop_thread: Any) -> None:
    tenant, k = namespace_id("a"), key("a", 1)
    loop_thread.run(pool.put_many([(k, b"r" * MiB)], 60))
    [pinned] = pool.locate([k], pin=True)
    assert pinned is not None
    assert loop_thread.run(pool.delete_many([k])) == 1  # gone from the index at once...
    assert pool.locate([k]) == [None]
    [other] = pool.reserve(tenant, [MiB])
    assert other != pinned.offset  # ...but its bytes stay while a reader copies them
    assert pool.arena(tenant).read(pinned.offset, 4) == b"rrrr"
    pool.unpin([pinned])
    pool.release(tenant, [(other, MiB)] if other is not None else [])
    assert pool.reserve(tenant, [MiB]) == [pinned.offset]  # the first free range again


def _unsealed_put(pool: MemoryPool, k: bytes, data: bytes) -> int:
    """A shared-memory put committed with its header left to the pool (as a WRITTEN-less COMMIT does)."""
    tenant = namespace_id("a")
    [offset] = pool.reserve(tenant, [HEADER_BYTES + len(data)])
    assert offset is not None
    pool.arena(tenant).write(offset + HEADER_BYTES, data)
    pool.commit(tenant, [(k, offset, HEADER_BYTES + len(data),
                          lambda s: seal(V4_1_FLASH.fingerprint, 200, b"", s))], ttl_s=60)
    return offset


def test_a_record_committed_unsealed_is_sealed_before_anyone_reads_it(pool: MemoryPool, loop_thread: Any) -> None:
    data = os.urandom(2_703_360)  # T = 200
    _unsealed_put(pool, key("a", 1), data)  # no sealing thread runs here: the reader seals it
    [record] = loop_thread.run(pool.get_many([key("a", 1)]))
    opened = unseal(record, V4_1_FLASH)
    assert opened is not None and opened.data == data and opened.position == 200


def test_the_sealing_thread_seals_committed_records(pool: MemoryPool) -> None:
    import time

    class Hooks:
        def admit(self, tenant: str) -> None: ...
        def got(self, tenant: str, asked: int, found: int, corrupt: int) -> None: ...
        def put(self, snapshots: int, nbytes: int) -> None: ...

    pool.shm_server(Hooks())  # starts the sealing thread
    data = os.urandom(2_703_360)
    offset = _unsealed_put(pool, key("a", 2), data)
    arena = pool.arena(namespace_id("a"))
    deadline = time.monotonic() + 10
    while arena.read(offset, 4) != b"SWA2" and time.monotonic() < deadline:
        time.sleep(0.01)
    record = arena.read(offset, HEADER_BYTES + len(data))  # read straight from the arena, not through the pool
    opened = unseal(record, V4_1_FLASH)
    assert opened is not None and opened.data == data


def test_an_arena_that_cannot_be_made_is_a_counted_miss(pool: MemoryPool, loop_thread: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.errors import Unavailable
    from tiers import swa_memory

    def no_room(*args: object, **kwargs: object) -> Arena:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(swa_memory, "Arena", no_room)
    with pytest.raises(Unavailable, match="Cannot allocate memory"):
        loop_thread.run(pool.put_many([(key("z", 1), b"x")], 60))  # SwaCache answers it as a failed put
