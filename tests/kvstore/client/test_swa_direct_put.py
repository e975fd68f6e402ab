"""The direct path's streamed put on a real redis-server: each record is checksummed piece by piece as it
is sent to a temporary key under a placeholder header, sealed there (SETRANGE) and renamed to its key,
so a key holds a whole sealed record or nothing, never a placeholder."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import xxhash

from kvstore.client import swa_direct, swa_put
from kvstore.client.swa_direct import DirectPath
from kvstore.clock import ManualClock
from kvstore.errors import PermissionDenied
from kvstore.geometry import TINY, V4_1_FLASH, ModelGeometry
from kvstore.swa_snapshot import (
    HEADER_BYTES,
    PLACEHOLDER_HEADER,
    checksum,
    checksum_stream,
    seal,
    snapshot_bytes,
    unseal,
)
from kvstore.v1 import swa_pb2 as pb
from tests.waiting import wait_until
from tiers.swa_acl import AclUsers

PREFIX = b"kvstore:swa:test:"
TTL_MS = 60_000


@pytest.mark.parametrize("size", [0, 1, 239, 240, 241, 1024, 65_537, 2_703_360])
@pytest.mark.parametrize("piece", [1, 7, 256, 4096, 1 << 20])
def test_a_streamed_checksum_is_the_checksum_of_the_whole(size: int, piece: int) -> None:
    """xxh3-64's streaming state gives the one-shot digest whatever the pieces (the header a streamed
    put writes must equal what `unseal` recomputes over the whole record)."""
    data = os.urandom(size)
    digest = checksum_stream()
    view = memoryview(data)
    for start in range(0, size, piece):
        digest.update(view[start:start + piece])
    assert digest.intdigest() == checksum(data) == xxhash.xxh3_64_intdigest(data)


def test_the_placeholder_header_is_never_opened() -> None:
    data = os.urandom(snapshot_bytes(TINY, 3))
    assert len(PLACEHOLDER_HEADER) == HEADER_BYTES
    assert unseal(PLACEHOLDER_HEADER + data, TINY) is None
    assert unseal(seal(TINY.fingerprint, 3, data, checksum(data)), TINY) is not None


def _grant(server: Any, raw: redis.Redis, *, commands: tuple[str, ...] | None = None) -> pb.SwaOpenDirectResponse:
    """A writer's grant on `server`: the gateway's own user (tiers.swa_acl), or one with only `commands`."""
    if commands is None:
        users = AclUsers(raw.execute_command, lifetime_s=600, clock=ManualClock())
        user = users.grant("test", PREFIX + b"*", writable=True)
        name, password = user.username, user.password
    else:
        name, password = "kvstore-swa-partial", "secret"
        raw.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", "~" + PREFIX.decode() + "*",
                            "-@all", *commands)
    return pb.SwaOpenDirectResponse(offered=True, redis_url=server.url, username=name, password=password,
                                    key_prefix=PREFIX, ttl_ms=TTL_MS, writable=True, max_record_bytes=64 << 20,
                                    expires_in_ms=600_000, renew_after_ms=300_000, tenant="test")


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as r:
        yield r


def _direct(server: Any, raw: redis.Redis, geometry: ModelGeometry, *, overlap: bool | None = None,
            **kwargs: Any) -> DirectPath:
    return DirectPath(_grant(server, raw, **kwargs), fingerprint=geometry.fingerprint, geometry=geometry,
                      timeout_s=10, overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("geometry", "piece"), [(V4_1_FLASH, swa_put.STREAM_CHUNK_BYTES), (TINY, 1000)])
def test_a_streamed_put_stores_each_record_sealed_under_its_ttl(
        redis_server: Any, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch, geometry: ModelGeometry,
        piece: int, overlap: bool) -> None:
    """Records of several pieces, even and odd T, from bytes, bytearray and memoryview, checksummed
    after each piece is sent or on the worker thread beside the send: each stored record is byte for
    byte the one `seal` makes, opens with `unseal`, and expires."""
    monkeypatch.setattr(swa_put, "STREAM_CHUNK_BYTES", piece)
    direct = _direct(redis_server, raw, geometry, overlap=overlap)
    positions = [geometry.window, geometry.window + 1, 3]
    datas = [os.urandom(snapshot_bytes(geometry, t)) for t in positions]
    assert max(map(len, datas)) > piece  # every geometry's records go in several pieces
    sent: list[bytes | bytearray | memoryview] = [datas[0], bytearray(datas[1]), memoryview(datas[2])]
    keys = [b"k%d" % t for t in positions]
    try:
        stored = direct.put_many(list(zip(keys, positions, sent, strict=True)))  # type: ignore[arg-type]
        assert stored == sum(map(len, datas))
        for key, t, data in zip(keys, positions, datas, strict=True):
            record = raw.get(direct.key(key))
            assert record == seal(geometry.fingerprint, t, data, checksum(data))
            opened = unseal(record, geometry)
            assert opened is not None and opened.position == t and opened.data == data
            assert 0 < raw.pttl(direct.key(key)) <= TTL_MS
        got = direct.get_many(keys)
        assert [bytes(d) for d in got.data if d is not None] == datas and got.corrupt == 0
    finally:
        direct.close()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("commands", [("+get", "+set", "+rename"), ("+get", "+set")])
def test_a_record_that_cannot_be_sealed_is_removed_wherever_it_got_to(redis_server: Any, raw: redis.Redis,
                                                                       commands: tuple[str, ...],
                                                                       overlap: bool) -> None:
    """A user without SETRANGE (and with or without RENAME): the put is PermissionDenied, and each
    placeholder record is removed (an empty value expiring at once) from the key it was renamed to,
    or from its temporary key: no reader finds a placeholder, nothing is left behind."""
    direct = _direct(redis_server, raw, TINY, commands=commands, overlap=overlap)
    data = os.urandom(snapshot_bytes(TINY, 4))
    try:
        with pytest.raises(PermissionDenied):
            direct.put_many([(b"k", 4, data), (b"j", 4, data), (b"k", 4, data)])
        assert direct.get_many([b"k", b"j"]).data == [None, None]  # the connection is in step after the refusal
        # Whatever is left is an emptied placeholder expiring at once (PX 1 ms): gone as soon as Redis sees it.
        assert all(raw.pttl(k) in (-2, 0, 1) for k in raw.keys(PREFIX + b"*")), "a placeholder left to live"
        wait_until(lambda: raw.keys(PREFIX + b"*") == [], "a placeholder record stayed behind")
    finally:
        direct.close()


def test_records_go_through_temporary_keys_of_their_own(redis_server: Any, raw: redis.Redis) -> None:
    """Each record is written and sealed under a temporary key of its call and index, then renamed: the
    same key twice in one batch ends as the last record, and no temporary key is left behind."""
    commands: list[bytes] = []
    renames: list[str] = []
    monitor = raw.monitor()
    direct = _direct(redis_server, raw, TINY, overlap=False)
    datas = [os.urandom(snapshot_bytes(TINY, 4)) for _ in range(2)]
    try:
        with monitor:
            direct.put_many([(b"k", 4, datas[0]), (b"k", 4, datas[1])])
            direct.put_many([(b"j", 4, datas[0])])
            while len(commands) < 9:
                words = monitor.next_command()["command"].split()
                if words[0] in ("SET", "SETRANGE", "RENAME"):  # not the connection's AUTH, HELLO, ...
                    commands.append(words[0].encode())
                    renames.extend(words[1:] if words[0] == "RENAME" else [])
        assert commands == [b"SET", b"SETRANGE", b"RENAME"] * 3
        assert len(set(renames[0:4:2])) == 2 and renames[1] == renames[3]  # two temporary keys, one target
        assert raw.get(direct.key(b"k")) == seal(TINY.fingerprint, 4, datas[1], checksum(datas[1]))
        assert sorted(raw.keys(PREFIX + b"*")) == sorted([direct.key(b"k"), direct.key(b"j")])
    finally:
        direct.close()


def test_a_failed_put_leaves_the_connection_usable_for_the_next(redis_server: Any, raw: redis.Redis) -> None:
    """A put refused part-way (a user without MULTI: every record's commands are refused) reads every
    reply, so a later put on a user that may write succeeds on the same client."""
    bad = _direct(redis_server, raw, TINY, commands=("+get", "+ping"))
    good = _direct(redis_server, raw, TINY)
    data = os.urandom(snapshot_bytes(TINY, 4))
    try:
        with pytest.raises(PermissionDenied):
            bad.put_many([(b"a", 4, data), (b"b", 4, data)])
        assert raw.exists(bad.key(b"a"), bad.key(b"b")) == 0
        assert good.put_many([(b"a", 4, data)]) == len(data)
        assert bytes(good.get_many([b"a"]).data[0] or b"") == data
    finally:
        bad.close()
        good.close()


def test_an_overlapped_put_seals_each_record_after_its_set_and_renames_it_last(
        redis_server: Any, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the checksum on the worker thread, a record's SETRANGE and RENAME may follow a later record's
    SET (its checksum came in later): each record's own commands still go SET, SETRANGE, RENAME on its own
    temporary key, and every record ends sealed under its key. The worker is held back until the last
    SET is sent, so the deferred order is the one taken."""
    monkeypatch.setattr(swa_put, "STREAM_CHUNK_BYTES", 1000)
    gate = threading.Event()
    real = swa_put.swa_digest.digest

    def late(view: Any) -> int:
        gate.wait(10)
        return real(view)

    original_send = None

    def send(conn: Any, args: Any, check: bool = True) -> None:  # the third record's SET releases the worker
        assert original_send is not None
        original_send(args, check)
        if any(b"~" in bytes(a)[:200] and b".2\r\n" in bytes(a)[:200] for a in args):
            gate.set()

    monkeypatch.setattr(swa_put.swa_digest, "digest", late)
    direct = _direct(redis_server, raw, TINY, overlap=True)
    positions = [4, 5, 6]
    datas = [os.urandom(snapshot_bytes(TINY, t)) for t in positions]
    keys = [b"a", b"b", b"c"]
    words: list[list[str]] = []
    monitor = raw.monitor()
    try:
        with monitor:
            conn = direct.redis.connection_pool.get_connection()
            original_send = conn.send_packed_command
            monkeypatch.setattr(conn, "send_packed_command", lambda args, check=True: send(conn, args, check))
            direct.redis.connection_pool.release(conn)
            direct.put_many(list(zip(keys, positions, datas, strict=True)))
            while len(words) < 9:
                command = monitor.next_command()["command"].split()
                if command[0] in ("SET", "SETRANGE", "RENAME"):
                    words.append(command)
        order = [w[0] for w in words]
        assert order[:3] == ["SET"] * 3  # every SET went out before the first checksum was in
        for temp in {w[1] for w in words}:
            assert [w[0] for w in words if w[1] == temp] == ["SET", "SETRANGE", "RENAME"]
        for key, t, data in zip(keys, positions, datas, strict=True):
            assert raw.get(direct.key(key)) == seal(TINY.fingerprint, t, data, checksum(data))
        assert sorted(raw.keys(PREFIX + b"*")) == sorted(direct.key(k) for k in keys)
    finally:
        gate.set()
        direct.close()


def test_a_checksum_that_fails_on_the_worker_fails_the_put_and_publishes_nothing(
        redis_server: Any, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's failure is raised on the caller's thread; no record reaches its key (their SETs went
    to temporary keys, never sealed nor renamed), and the next put on the client succeeds."""
    def broken(view: Any) -> int:
        raise MemoryError("checksum failed")

    direct = _direct(redis_server, raw, TINY, overlap=True)
    data = os.urandom(snapshot_bytes(TINY, 4))
    try:
        with monkeypatch.context() as patch:
            patch.setattr(swa_put.swa_digest, "digest", broken)
            with pytest.raises(MemoryError):
                direct.put_many([(b"k", 4, data), (b"j", 4, data)])
        assert raw.exists(direct.key(b"k"), direct.key(b"j")) == 0
        assert direct.put_many([(b"k", 4, data)]) == len(data)
        assert raw.get(direct.key(b"k")) == seal(TINY.fingerprint, 4, data, checksum(data))
    finally:
        direct.close()


def test_the_checksum_is_overlapped_from_four_cpus(redis_server: Any, raw: redis.Redis,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, overlap in ((2, False), (3, False), (4, True), (16, True)):
        monkeypatch.setattr(swa_direct, "usable_cpus", lambda cpus=cpus: cpus)
        direct = _direct(redis_server, raw, TINY)
        assert direct.overlap is overlap
        direct.close()
