"""The direct path's streamed put on a real redis-server: each record is checksummed piece by piece as it
is sent to a temporary key under a placeholder header, sealed there (SETRANGE) and renamed to its key,
so a key holds a whole sealed record or nothing, never a placeholder."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import xxhash

from kvstore.client import swa_direct
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


def _direct(server: Any, raw: redis.Redis, geometry: ModelGeometry, **kwargs: Any) -> DirectPath:
    return DirectPath(_grant(server, raw, **kwargs), fingerprint=geometry.fingerprint, geometry=geometry,
                      timeout_s=10)


@pytest.mark.parametrize(("geometry", "piece"), [(V4_1_FLASH, swa_direct.STREAM_CHUNK_BYTES), (TINY, 1000)])
def test_a_streamed_put_stores_each_record_sealed_under_its_ttl(
        redis_server: Any, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch, geometry: ModelGeometry,
        piece: int) -> None:
    """Records of several pieces, even and odd T, from bytes, bytearray and memoryview: each stored
    record is byte for byte the one `seal` makes, opens with `unseal`, and expires."""
    monkeypatch.setattr(swa_direct, "STREAM_CHUNK_BYTES", piece)
    direct = _direct(redis_server, raw, geometry)
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


@pytest.mark.parametrize("commands", [("+get", "+set", "+rename"), ("+get", "+set")])
def test_a_record_that_cannot_be_sealed_is_removed_wherever_it_got_to(redis_server: Any, raw: redis.Redis,
                                                                       commands: tuple[str, ...]) -> None:
    """A user without SETRANGE (and with or without RENAME): the put is PermissionDenied, and the
    placeholder record is removed (an empty value expiring at once) from the key it was renamed to,
    or from its temporary key: no reader finds a placeholder, nothing is left behind."""
    direct = _direct(redis_server, raw, TINY, commands=commands)
    data = os.urandom(snapshot_bytes(TINY, 4))
    try:
        with pytest.raises(PermissionDenied):
            direct.put_many([(b"k", 4, data)])
        assert direct.get_many([b"k"]).data == [None]  # the connection is in step after the refusal
        time.sleep(0.05)  # the emptied key's PX of 1 ms
        assert raw.keys(PREFIX + b"*") == []
    finally:
        direct.close()


def test_records_go_through_temporary_keys_of_their_own(redis_server: Any, raw: redis.Redis,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each record is written and sealed under a temporary key of its call and index, then renamed: the
    same key twice in one batch ends as the last record, and no temporary key is left behind."""
    commands: list[bytes] = []
    renames: list[str] = []
    monitor = raw.monitor()
    direct = _direct(redis_server, raw, TINY)
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
