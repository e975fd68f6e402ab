"""The embedded pool's shared memory: per-tenant sealed arenas, their allocator, and the reserve/commit steps
the shared-memory path uses, under the same cap, LRU and TTL as the gateway path (real memfds)."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.clock import ManualClock
from kvstore.errors import Internal, PermissionDenied
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import namespace_id
from kvstore.swa_snapshot import HEADER_BYTES, seal, unseal
from tests.shm_attacks import routes_as_nobody, routes_that_write
from tiers.swa_memory import MemoryPool, arena_id
from tiers.swa_shm import GRANULE, READ_ONLY_SEALS, SEALS, Arena, Reserved
from tiers.swa_shm_session import ShmGrant

ATTACKS = Path(__file__).parents[1] / "shm_attacks.py"

MiB = 1 << 20
FP = b"f" * 8


def key(tenant: str, i: int) -> bytes:
    return FP + namespace_id(tenant) + i.to_bytes(4, "little") + bytes(28)


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena("kvstore-swa-test", 16 * GRANULE, idle_limit=4 * GRANULE)
    yield a
    a.close()


@pytest.fixture
def staging() -> Iterator[Arena]:
    a = Arena("kvstore-swa-staging-test", 16 * GRANULE, idle_limit=4 * GRANULE, clients_write=True)
    yield a
    a.close()


def test_an_arena_is_sealed_against_resizing(arena: Arena, staging: Arena) -> None:
    for a in (arena, staging):
        assert fcntl.fcntl(a.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        with pytest.raises(PermissionError):
            os.ftruncate(a.fd, GRANULE)  # a client could otherwise make the server's mapping fault


def test_no_descriptor_of_an_arena_can_be_made_writable(arena: Arena) -> None:
    """docs/SECURITY.md: a reader cannot write, by any route: the file is sealed against writes
    (F_SEAL_FUTURE_WRITE) once the server's own mapping exists, whoever reopens it and however."""
    assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) == READ_ONLY_SEALS
    arena.write(GRANULE, b"kept")
    fd = arena.open_fd(writable=False)
    try:
        assert routes_that_write(fd, arena.size) == []
        # Another process, through this one's /proc (the tests run as root, so it may open it).
        out = subprocess.run([sys.executable, str(ATTACKS), f"/proc/{os.getpid()}/fd/{fd}", str(arena.size)],
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out) == []
        view = mmap.mmap(fd, arena.size, prot=mmap.PROT_READ)
        arena.write(GRANULE, b"seen")
        assert view[GRANULE:GRANULE + 4] == b"seen"  # the same pages, and the server still writes them
        view.close()
    finally:
        os.close(fd)
    with pytest.raises(Internal, match="staging"):
        arena.open_fd(writable=True)


def test_a_reader_of_another_user_cannot_write_the_arena(arena: Arena, staging: Arena) -> None:
    """The memfd's mode is 0777: the seal, not the mode, is what keeps another user out."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    for a, writable in ((arena, False), (staging, True)):
        fd = a.open_fd(writable=False)
        try:
            # An unsealed file's read-only descriptor is reopened read-write by nobody (the issue's
            # attack, so the check is not vacuous); the arena's is not, by any route.
            assert bool(routes_as_nobody(fd, a.size)) is writable
        finally:
            os.close(fd)


def test_a_staging_arena_is_writable(staging: Arena) -> None:
    fd = staging.open_fd(writable=True)
    try:
        assert routes_that_write(fd, staging.size)  # the test above is not vacuous: this one can be written
    finally:
        os.close(fd)


def test_allocations_are_pages_and_freed_ranges_coalesce(arena: Arena) -> None:
    taken = [arena.alloc(GRANULE + 1) for _ in range(8)]  # two granules each: the whole arena
    offsets = [o for o in taken if o is not None]
    assert offsets == [i * 2 * GRANULE for i in range(8)]
    assert arena.alloc(1) is None  # full
    for offset in offsets[2:6]:
        arena.free(offset, GRANULE + 1)
    assert arena.alloc(8 * GRANULE) == offsets[2]  # the four freed neighbours are one range again
    arena.free(offsets[0], GRANULE + 1)
    arena.free(offsets[1], GRANULE + 1)
    assert arena.alloc(4 * GRANULE) == 0


def test_freed_pages_past_the_idle_limit_go_back_to_the_kernel(staging: Arena, arena: Arena) -> None:
    for a in (staging, arena):
        offsets = [a.alloc(2 * GRANULE) for _ in range(4)]
        for offset in offsets:
            assert offset is not None
            a.write(offset, b"\xab" * 2 * GRANULE)
        assert not a.retirable
        for offset in offsets:
            assert offset is not None
            a.free(offset, 2 * GRANULE)
    # The first two frees stay committed (4 granules of idle budget); the rest are punched out: zeros.
    assert staging.read(0, 4) == b"\xab" * 4 and staging.read(6 * GRANULE, 4) == bytes(4)
    # A sealed arena cannot be punched (EPERM): it keeps them, and says it is to be let go instead.
    assert arena.read(6 * GRANULE, 4) == b"\xab" * 4 and arena.retirable and not staging.retirable


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
    [span] = pool.reserve(tenant, [HEADER_BYTES + 1000])
    assert span is not None
    pool.staging(tenant).write(span.staged + HEADER_BYTES, b"s" * 1000)
    assert loop_thread.run(pool.get_many([k])) == [None]  # not live before its commit
    pool.commit(tenant, [(k, span, lambda _: b"h" * HEADER_BYTES)], ttl_s=10)
    assert loop_thread.run(pool.get_many([k])) == [b"h" * HEADER_BYTES + b"s" * 1000]  # copied from staging
    [located] = pool.locate([k])
    assert located is not None and located.offset == span.offset and located.header == b"h" * HEADER_BYTES
    clock.advance(11)
    assert pool.locate([k]) == [None] and loop_thread.run(pool.usage()).expirations == 1


def test_reservations_count_against_the_cap_and_evict_the_least_recently_used(pool: MemoryPool,
                                                                              loop_thread: Any) -> None:
    tenant = namespace_id("a")
    loop_thread.run(pool.put_many([(key("a", i), os.urandom(MiB)) for i in range(4)], 60))  # the whole cap
    pool.locate([key("a", 0)])  # recently used: kept
    spans = pool.reserve(tenant, [MiB, MiB])
    assert None not in spans
    got = loop_thread.run(pool.get_many([key("a", i) for i in range(4)]))
    assert got[0] is not None and sum(g is not None for g in got) == 2  # two evicted for the reservation
    usage = loop_thread.run(pool.usage())
    assert usage.evictions == 2 and usage.bytes_used == 2 * MiB
    pool.release(tenant, [s for s in spans if s is not None])
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
    assert other is not None and other.offset != pinned.offset  # ...but its bytes stay while a reader copies them
    assert pool.arena(tenant).read(pinned.offset, 4) == b"rrrr"
    pool.unpin([pinned])
    pool.release(tenant, [other])
    [again] = pool.reserve(tenant, [MiB])
    assert again is not None and again.offset == pinned.offset  # the first free range again


def _unsealed_put(pool: MemoryPool, k: bytes, data: bytes) -> Reserved:
    """A shared-memory put committed with its header left to the pool (as a WRITTEN-less COMMIT does):
    the snapshot is in its staging range until the pool settles it in the arena."""
    tenant = namespace_id("a")
    [span] = pool.reserve(tenant, [HEADER_BYTES + len(data)])
    assert span is not None
    pool.staging(tenant).write(span.staged + HEADER_BYTES, data)
    pool.commit(tenant, [(k, span, lambda s: seal(V4_1_FLASH.fingerprint, 200, b"", s))], ttl_s=60)
    return span


def test_a_record_committed_unsealed_is_sealed_before_anyone_reads_it(pool: MemoryPool, loop_thread: Any) -> None:
    data = os.urandom(2_703_360)  # T = 200
    span = _unsealed_put(pool, key("a", 1), data)  # no sealing thread runs here: the reader seals it
    [record] = loop_thread.run(pool.get_many([key("a", 1)]))
    opened = unseal(record, V4_1_FLASH)
    assert opened is not None and opened.data == data and opened.position == 200
    # Settled: the staging range is free again, and what the writer does to it now changes nothing.
    pool.staging(namespace_id("a")).write(span.staged + HEADER_BYTES, b"\0" * 4096)
    assert loop_thread.run(pool.get_many([key("a", 1)])) == [record]
    [again] = pool.reserve(namespace_id("a"), [HEADER_BYTES + len(data)])
    assert again is not None and again.staged == span.staged


def test_the_sealing_thread_seals_committed_records(pool: MemoryPool) -> None:
    from tests.waiting import wait_until

    pool.shm_server(Hooks())  # starts the sealing thread
    data = os.urandom(2_703_360)
    offset = _unsealed_put(pool, key("a", 2), data).offset
    arena = pool.arena(namespace_id("a"))
    wait_until(lambda: arena.read(offset, 4) == b"SWA2", "the sealing thread sealed the put")
    record = arena.read(offset, HEADER_BYTES + len(data))  # read straight from the arena, not through the pool
    opened = unseal(record, V4_1_FLASH)
    assert opened is not None and opened.data == data


def test_a_record_replaced_before_the_sealing_thread_came_to_it_is_never_sealed(pool: MemoryPool,
                                                                               loop_thread: Any) -> None:
    """A shared-memory put replaced while still queued for the sealing thread frees its range at once; the
    thread must skip it, or it writes the old record's header over whatever took that range (bench swa's
    'snapshot missing during the benchmark': a gateway put replacing a shared-memory one, then corrupt)."""
    from tests.waiting import wait_until

    data = os.urandom(1 << 20)  # two fit the pool's cap; the pool never opens a record
    k = key("a", 1)
    span = _unsealed_put(pool, k, data)  # no sealing thread runs yet: queued, unsealed
    replacement = b"p" * (HEADER_BYTES + len(data))
    loop_thread.run(pool.put_many([(k, replacement)], 60))  # the gateway's put of the same key
    assert pool.locate([k])[0].offset == span.offset  # type: ignore[union-attr]  # it took the freed range
    pool.shm_server(Hooks())  # starts the sealing thread
    later = _unsealed_put(pool, key("a", 2), data).offset
    arena = pool.arena(namespace_id("a"))
    # The thread takes its queue in order: once the later put is sealed, it has been past the replaced one.
    wait_until(lambda: arena.read(later, 4) == b"SWA2", "the sealing thread sealed the later put")
    assert loop_thread.run(pool.get_many([k])) == [replacement]


def test_an_arena_that_cannot_be_made_is_a_counted_miss(pool: MemoryPool, loop_thread: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.errors import Unavailable
    from tiers import swa_memory

    def no_room(*args: object, **kwargs: object) -> Arena:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(swa_memory, "Arena", no_room)
    with pytest.raises(Unavailable, match="Cannot allocate memory"):
        loop_thread.run(pool.put_many([(key("z", 1), b"x")], 60))  # SwaCache answers it as a failed put


def test_an_emptied_arena_is_let_go_and_its_sessions_must_open_anew(pool: MemoryPool, loop_thread: Any) -> None:
    """A sealed arena cannot punch freed pages out: once it holds nothing after growing past its idle
    budget (cap / 4 here), the pool lets it go, and a session handed the old one is told to open anew."""
    tenant = namespace_id("a")
    loop_thread.run(pool.put_many([(key("a", i), os.urandom(MiB)) for i in range(3)], 60))
    old = pool.arena(tenant)
    assert old.high > old.idle_limit
    assert loop_thread.run(pool.delete_many([key("a", i) for i in range(3)])) == 3
    loop_thread.run(pool.put_many([(key("a", 9), b"n" * 100)], 60))  # the next call lets it go first
    new = pool.arena(tenant)
    assert new is not old and loop_thread.run(pool.get_many([key("a", 9)])) == [b"n" * 100]
    assert pool.locate([key("a", 9)], arena=old) == [None]  # a stale session finds nothing in it...
    with pytest.raises(PermissionDenied, match="renewed"):
        pool.reserve(tenant, [MiB], arena=old)  # ...and may not put there
    [span] = pool.reserve(tenant, [MiB], arena=new)
    assert span is not None


class Hooks:
    """The gateway's side of the shared-memory path, recorded (tiers.swa_shm_session.ShmHooks)."""

    def __init__(self) -> None:
        self.corrupt = 0
        #: (tenant, keys, found or stored) of each get and put, as the gateway's trace records them.
        self.gets: list[tuple[str, list[bytes], int]] = []
        self.puts: list[tuple[str, list[bytes], int, int]] = []

    def admit(self, tenant: str) -> None: ...

    def got(self, grant: ShmGrant, keys: Sequence[bytes], found: int, corrupt: int) -> None:
        self.corrupt += corrupt
        self.gets.append((grant.tenant, list(keys), found))

    def put(self, grant: ShmGrant, keys: Sequence[bytes], stored: int, nbytes: int) -> None:
        self.puts.append((grant.tenant, list(keys), stored, nbytes))


def shm_path(pool: MemoryPool, hooks: Hooks, clock: ManualClock, *, writable: bool = True,
             verify: bool = False) -> Any:
    """A real client session (kvstore.client.swa_shm.ShmPath) on this pool's control socket, tenant a."""
    from kvstore.client.swa_shm import ShmPath
    from kvstore.v1 import swa_pb2 as pb
    from tiers.swa_shm_server import ShmGrant, host_id

    server = pool.shm_server(hooks)
    ticket = server.grant(ShmGrant(tenant="a", tenant_id=namespace_id("a"), fingerprint=V4_1_FLASH.fingerprint,
                                   geometry=V4_1_FLASH, writable=writable, ttl_s=60, max_batch=64,
                                   expires_s=clock.monotonic() + 600))
    grant = pb.SwaOpenDirectResponse(offered=True, tenant="a", shm_socket=server.name, shm_ticket=ticket,
                                     shm_host=host_id(), writable=writable)
    return ShmPath(grant, geometry=V4_1_FLASH, timeout_s=10, verify=verify)


def test_each_get_and_commit_tells_the_gateway_its_tenant_and_the_clients_keys(clock: ManualClock,
                                                                              loop_thread: Any) -> None:
    """What the gateway counts and traces per shared-memory call (gateway/trace_recorder.py records it): the
    grant's tenant, the client's own 32-byte keys (not the pool's storage keys) and how many were served or
    stored."""
    pool = MemoryPool(cap_bytes=64 * MiB, clock=clock)
    hooks = Hooks()
    writer = shm_path(pool, hooks, clock)
    try:
        one, two, missing = b"1" * 32, b"2" * 32, b"m" * 32
        data = [os.urandom(2_703_360), os.urandom(2_703_360)]  # T = 200
        assert writer.put_many([(one, 200, data[0]), (two, 200, data[1])], ttl_ms=60_000) == 2 * len(data[0])
        assert writer.get_many([two, missing, one]).data == [data[1], None, data[0]]
        assert hooks.puts == [("a", [one, two], 2, 2 * len(data[0]))]
        assert hooks.gets == [("a", [two, missing, one], 2)]
    finally:
        writer.close()
        loop_thread.run(pool.close())


@pytest.mark.parametrize("verify", [False, True])
def test_a_default_reader_never_returns_bytes_changed_after_commit(clock: ManualClock, loop_thread: Any,
                                                                   verify: bool) -> None:
    """docs/SECURITY.md: every shared-memory get checks its copy against the server's checksum, so a
    byte changed in the arena after COMMIT (here through the server's own mapping, the one writer left)
    is a counted miss, never wrong bytes; a writer scribbling on its staging range after COMMIT changes
    nothing readers get."""
    pool = MemoryPool(cap_bytes=64 * MiB, clock=clock)
    hooks = Hooks()
    writer = shm_path(pool, hooks, clock, verify=verify)
    reader = shm_path(pool, hooks, clock, writable=False)
    try:
        data = os.urandom(2_703_360)  # T = 200
        k = b"k" * 32
        assert writer.put_many([(k, 200, data)], ttl_ms=60_000) == len(data)
        assert reader.get_many([k]).data == [data]  # settled and sealed by this first reader, or at COMMIT
        staged = writer._staged  # the writer's own mapping of its staging arena
        at = bytes(staged[:16 * MiB]).find(data[:4096])
        assert at >= 0
        staged[at:at + 64] = bytes(64)  # too late: the arena holds the server's copy
        assert reader.get_many([k]).data == [data] and writer.get_many([k]).data == [data]
        arena = pool.arena(namespace_id("a"))
        at = bytes(arena.view[:16 * MiB]).find(data[:4096])
        arena.write(at + 100, bytes([data[100] ^ 1]))  # changed after commit, where readers map it
        got = reader.get_many([k])
        assert got.data == [None] and got.corrupt == 1
        assert writer.get_many([k]).data == [None]
        reader.get_many([b"x" * 32])  # the next GET carries each one's count to the server
        writer.get_many([b"x" * 32])
        assert hooks.corrupt == 2
    finally:
        writer.close()
        reader.close()
        loop_thread.run(pool.close())
