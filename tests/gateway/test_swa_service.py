"""The SwaPool service end to end: a real gRPC server over each real backend, and its faults."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import redis

from kvstore.client import Client, SwaClient
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, SwaSettings
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from kvstore.swa_snapshot import HEADER_BYTES, seal, serves
from kvstore.v1 import kvstore_pb2 as kvpb
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tests.waiting import wait_until
from tiers.swa_redis import redis_key


def swa_settings(request: pytest.FixtureRequest, backend: str, **kwargs: Any) -> SwaSettings:
    if backend == "redis":
        kwargs["redis_url"] = request.getfixturevalue("redis_server").url
    elif backend == "redis-cluster":
        kwargs["cluster_nodes"] = request.getfixturevalue("redis_cluster").startup_nodes
    kwargs.setdefault("cap_bytes", 256 << 20)
    return SwaSettings(backend=backend, **kwargs)


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def swa_client(request: pytest.FixtureRequest, start_server: Callable[..., Any],
               store_settings: StoreSettings) -> Iterator[Client]:
    """A client of a server whose SWA pool is the parametrized backend."""
    server = start_server(store_settings, swa=swa_settings(request, request.param))
    with Client(server.target) as c:
        yield c


def snapshot(client: Client, position: int) -> bytes:
    """Random bytes of the size of a snapshot at T = `position`."""
    return os.urandom(client.swa.snapshot_bytes(position))


def test_put_get_delete_round_trip(swa_client: Client) -> None:
    swa = swa_client.swa
    tokens = list(range(200))
    prompt_end, output_end = snapshot(swa_client, 60), snapshot(swa_client, 200)
    assert swa.put(tokens[:60], prompt_end).stored == 1
    assert swa.put(tokens, output_end).stored == 1
    assert swa.get(tokens[:60]) == prompt_end
    assert swa.get(tokens, 60) == prompt_end  # the same point named by position
    assert swa.get(tokens) == output_end
    assert swa.get(tokens, 59) is None
    stub = pb_grpc.SwaPoolStub(swa_client.connection.channel)
    reply = stub.Get(pb.SwaGetRequest(keys=[swa.key(tokens, 60), swa.key(tokens)]))
    assert [r.position for r in reply.results] == [60, 200]  # T comes back from the record
    assert swa.delete_many([swa.key(tokens)]) == 1
    assert swa.get(tokens) is None
    stats = swa.stats()
    assert stats.backend_up and stats.snapshots_put == 2 and stats.hits == 5 and stats.snapshots_asked == 7


def test_snapshots_of_each_length_have_their_own_size(swa_client: Client) -> None:
    """Short, odd (with the raw tail) and full-window snapshots are stored and read back whole."""
    swa = swa_client.swa
    tokens = list(range(300))
    sizes = {t: swa.snapshot_bytes(t) for t in (1, 2, 99, 100, 128, 129, 300)}
    assert sizes[128] == sizes[300] == 2_703_360 and sizes[129] == 2_703_360 + 12_288
    assert sizes[1] == 40 * 528 + 12_288 and sizes[100] == 40 * 100 * 528
    datas = {t: os.urandom(size) for t, size in sizes.items()}
    assert swa.put_many([(swa.key(tokens, t), t, d) for t, d in datas.items()]).stored == len(datas)
    assert swa.get_many([swa.key(tokens, t) for t in datas]) == list(datas.values())


def test_batches_fit_the_message_limit_by_each_snapshots_own_size(start_server: Callable[..., Any],
                                                                 store_settings: StoreSettings) -> None:
    """Short snapshots share a call; full-window ones are split by bytes (8 MiB messages, 1 MiB
    kept for the envelope: two per call), and never more than the server's max_batch_snapshots."""
    from kvstore.config import ServerSettings

    server = start_server(store_settings, server=ServerSettings(port=0, max_message_bytes=8 << 20),
                          swa=SwaSettings(cap_bytes=256 << 20, max_batch_snapshots=5))
    with Client(server.target) as client:
        swa = SwaClient(client.connection, path="gateway")  # the shared-memory path batches by count alone
        tokens = list(range(300))
        short = [(swa.key(tokens, t), t, snapshot(client, t)) for t in range(1, 7)]  # 6 x 21-34 KB
        full = [(swa.key(tokens, t), t, snapshot(client, t)) for t in range(200, 206)]  # 6 x 2.7 MB
        assert swa.put_many(short).stored == 6
        assert swa.stats().puts == 2  # 5 + 1: the server's batch limit
        assert swa.put_many(full).stored == 6
        assert swa.stats().puts == 2 + 3
        assert swa.get_many([k for k, _, _ in full]) == [d for _, _, d in full]
        assert swa.stats().gets == 3


def lookup(client: Client, tokens: list[int], positions: list[int], limit: int = 0) -> kvpb.LookupResponse:
    """A raw Lookup with SWA candidates at `positions` and a resume limit."""
    return client.connection.call(client.connection.kvstore.Lookup, kvpb.LookupRequest(
        block_hashes=client.hashes(tokens), swa_keys=client.swa.keys(tokens, positions),
        swa_positions=positions, swa_resume_limit=limit))


def served(reply: kvpb.LookupResponse) -> tuple[int, int] | None:
    """(T, R) of the snapshot a Lookup names, or None."""
    return (reply.swa_position, reply.swa_resume_tokens) if reply.swa_found else None


def stored(client: Client, tokens: list[int], blocks: int, positions: list[int]) -> None:
    """The first `blocks` blocks of `tokens` and a snapshot at each position."""
    if blocks:
        client.put(tokens[: blocks * client.block_tokens], [os.urandom(client.block_bytes) for _ in range(blocks)])
    client.swa.put_many([(client.swa.key(tokens, t), t, snapshot(client, t)) for t in positions])


def test_resume_an_even_snapshot_at_or_above_the_window_serves_t_and_t_minus_1_not_t_minus_2(
        client: Client) -> None:
    b = client.block_tokens
    tokens = list(range(12 * b))
    stored(client, tokens, 12, [160])
    assert served(lookup(client, tokens, [160])) == (160, 160)
    assert served(lookup(client, tokens, [160], limit=159)) == (160, 159)
    assert served(lookup(client, tokens, [160], limit=158)) is None
    reply = lookup(client, tokens, [150, 160, 170], limit=159)
    assert reply.swa_index == 1 and reply.found_tokens == 12 * b


def test_resume_an_odd_snapshot_serves_only_its_own_length(client: Client) -> None:
    tokens = list(range(12 * client.block_tokens))
    stored(client, tokens, 12, [161, 101])
    assert served(lookup(client, tokens, [161])) == (161, 161)
    assert served(lookup(client, tokens, [161], limit=160)) is None
    assert served(lookup(client, tokens, [101], limit=100)) is None  # below the window too
    assert served(lookup(client, tokens, [101])) == (101, 101)


def test_resume_an_even_snapshot_below_the_window_serves_any_shorter_length(client: Client) -> None:
    b = client.block_tokens
    tokens = list(range(12 * b))
    stored(client, tokens, 4, [100])
    assert served(lookup(client, tokens, [100])) == (100, 4 * b)  # as far as the found blocks go
    assert served(lookup(client, tokens, [100], limit=37)) == (100, 37)


def test_resume_needs_the_global_rows_below_its_length(client: Client) -> None:
    """A snapshot past the found blocks cannot serve: the rows of the positions between
    them and its resume length are neither stored nor recomputable from its window."""
    b = client.block_tokens
    tokens = list(range(12 * b))
    stored(client, tokens, 10, [10 * b + 4, 10 * b + 1])
    assert lookup(client, tokens, [10 * b + 4, 10 * b + 1]).found_tokens == 10 * b
    assert served(lookup(client, tokens, [10 * b + 4, 10 * b + 1])) is None
    assert served(lookup(client, tokens[:5], [5])) is None  # no block found: no resume at all


def test_lookup_names_the_live_snapshot_that_serves_the_longest_resume(swa_client: Client) -> None:
    b = swa_client.block_tokens
    tokens = list(range(4 * b + 5))
    stored(swa_client, tokens, 2, [b, 2 * b + 3, 4 * b + 5])
    candidates = [b, 2 * b, 2 * b + 3, 3 * b, 4 * b + 5]
    # 4b+5 and 2b+3 are odd past the found 2b tokens; 2b and 3b have no snapshot.
    found = swa_client.lookup(tokens, swa_positions=candidates)
    assert found.found_tokens == 2 * b and found.swa_position == b
    swa_client.swa.put(tokens, snapshot(swa_client, 3 * b), position=3 * b)
    assert served(lookup(swa_client, tokens, candidates)) == (3 * b, 2 * b)  # below the window: any shorter
    assert swa_client.lookup(tokens).swa_position is None


def test_lookup_never_names_a_snapshot_that_cannot_serve(client: Client) -> None:
    """Random snapshots, found blocks, candidates and limits against the rules, applied by brute force."""
    import random

    rng = random.Random(10)
    b = client.block_tokens
    tokens = list(range(20 * b))
    live = rng.sample(range(1, 20 * b), 40)
    stored(client, tokens, 0, live)
    found_blocks = 0
    for case in range(40):
        more = rng.randrange(0, 3)
        if more and found_blocks + more <= 20:
            client.put(tokens[: (found_blocks + more) * b], [os.urandom(client.block_bytes)] * more,
                       first_block=found_blocks)
            found_blocks += more
        candidates = rng.sample(range(1, 20 * b), 6) + rng.sample(live, 4)
        limit = rng.choice([0, rng.randrange(1, 20 * b)])
        reply = lookup(client, tokens, candidates, limit)
        assert reply.found_tokens == found_blocks * b
        most = min(found_blocks * b, limit or found_blocks * b)
        best = max(((r, -t) for t in candidates if t in live
                    for r in range(1, most + 1) if serves(V4_1_FLASH, t, r)), default=None)
        expected = (-best[1], best[0]) if best else None
        assert served(reply) == expected, (case, candidates, limit, found_blocks)
        if expected:
            assert candidates[reply.swa_index] == reply.swa_position


def test_wrong_size_position_or_checksum_is_rejected_on_put(swa_client: Client) -> None:
    swa = swa_client.swa
    with pytest.raises(InvalidArgument, match="SWA snapshot at T = 3 is"):
        swa.put([1, 2, 3], b"x" * (swa.snapshot_bytes(3) - 1))
    with pytest.raises(InvalidArgument, match="T is odd"):
        swa.put([1, 2, 3], snapshot(swa_client, 4), position=3)  # the size of another T
    with pytest.raises(InvalidArgument, match=r"at T = 200 is 2703360 bytes: 40 layers x 128 window rows"):
        swa.put(list(range(200)), snapshot(swa_client, 201))
    stub = pb_grpc.SwaPoolStub(swa_client.connection.channel)
    data = snapshot(swa_client, 3)
    bad = pb.SwaPutRequest(snapshots=[pb.SwaSnapshot(key=swa.key([1, 2, 3]), position=3, data=data, checksum=1)])
    with pytest.raises(grpc.RpcError) as info:
        stub.Put(bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in (info.value.details() or "")
    with pytest.raises(InvalidArgument, match="unknown geometry"):
        swa_client.connection.call(stub.Put, pb.SwaPutRequest(geometry="other", snapshots=bad.snapshots))
    without_t = pb.SwaPutRequest(snapshots=[pb.SwaSnapshot(key=swa.key([1, 2, 3]), data=data)])
    with pytest.raises(InvalidArgument, match=r"snapshots\[0\].position is 0: send T"):
        swa_client.connection.call(stub.Put, without_t)
    assert swa.get([1, 2, 3]) is None


def test_the_memory_pool_counts_each_records_real_bytes(client: Client) -> None:
    swa = client.swa
    tokens = list(range(300))
    lengths = (1, 50, 128, 129, 300)
    swa.put_many([(swa.key(tokens, t), t, snapshot(client, t)) for t in lengths])
    usage = swa.stats()
    assert usage.items == len(lengths)
    assert usage.bytes_used == sum(HEADER_BYTES + swa.snapshot_bytes(t) for t in lengths)


def test_memory_pool_expires_by_the_injected_clock(start_server: Callable[..., Any], store_settings: StoreSettings,
                                                  clock: ManualClock) -> None:
    server = start_server(store_settings, swa=SwaSettings(ttl_s=120, cap_bytes=64 << 20))
    with Client(server.target) as client:
        client.swa.put([1, 2, 3], snapshot(client, 3))
        client.swa.put([4, 5, 6], snapshot(client, 3), ttl_s=10)  # shorter than the operator's TTL
        clock.advance(11)
        assert client.swa.get([4, 5, 6]) is None and client.swa.get([1, 2, 3]) is not None
        assert client.swa.put([7], snapshot(client, 1), ttl_s=9999).ttl_ms == 120_000  # never longer
        clock.advance(110)
        assert client.swa.get([1, 2, 3]) is None
        stats = client.swa.stats()
        assert stats.expirations == 2 and stats.backend_errors == 0


def test_redis_expiry_is_a_miss_on_the_real_server(request: pytest.FixtureRequest, start_server: Callable[..., Any],
                                                   store_settings: StoreSettings, redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis", ttl_s=60.0))
    with Client(server.target) as client, redis.Redis(port=redis_server.port) as raw:
        client.swa.put([1, 2, 3], snapshot(client, 3))
        assert client.swa.get([1, 2, 3]) is not None
        key = redis_key(b"kvstore:swa:", BlockScope(client.fingerprint, "default").key(client.swa.key([1, 2, 3])))
        assert 0 < raw.pttl(key) <= 60_000, "stored with the operator's TTL"
        # The TTL runs out now, as it would in a minute (redis has no clock to move; a wait would race it).
        assert raw.pexpire(key, 1)
        wait_until(lambda: client.swa.get([1, 2, 3]) is None, "the expired snapshot was still served")
        stats = client.swa.stats()
        assert stats.expirations >= 1 and stats.backend_errors == 0


def test_redis_limits_are_set_at_connect(request: pytest.FixtureRequest, start_server: Callable[..., Any],
                                         store_settings: StoreSettings, redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis", cap_bytes=100 << 20))
    with Client(server.target) as client, redis.Redis(port=redis_server.port) as raw:
        client.swa.put([1], snapshot(client, 1))
        assert raw.config_get("maxmemory")["maxmemory"] == str(100 << 20)
        assert raw.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        key = redis_key(b"kvstore:swa:", BlockScope(client.fingerprint, "default").key(client.swa.key([1])))
        assert 0 < raw.pttl(key) <= 300_000
        assert client.swa.stats().cap_bytes == 100 << 20


def test_corrupt_or_foreign_record_is_a_counted_miss(request: pytest.FixtureRequest,
                                                     start_server: Callable[..., Any],
                                                     store_settings: StoreSettings, redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis"))
    with Client(server.target) as client, redis.Redis(port=redis_server.port) as raw:
        data = snapshot(client, 1)
        client.swa.put([1], data)
        client.swa.put([2], data)
        scope = BlockScope(client.fingerprint, "default")
        k1 = redis_key(b"kvstore:swa:", scope.key(client.swa.key([1])))
        k2 = redis_key(b"kvstore:swa:", scope.key(client.swa.key([2])))
        record = bytearray(raw.get(k1) or b"")
        record[1000] ^= 0xFF
        raw.set(k1, bytes(record))
        raw.set(k2, seal(b"\x01" * 8, 1, data, 0))  # another geometry's header
        assert client.swa.get_many([client.swa.key([1]), client.swa.key([2])]) == [None, None]
        assert client.swa.stats().corrupt == 2


def test_redis_down_gives_misses_and_kv_keeps_serving_then_recovers(
        request: pytest.FixtureRequest, start_server: Callable[..., Any], store_settings: StoreSettings,
        redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis", socket_timeout_s=5.0))
    with Client(server.target) as client:
        tokens = list(range(client.block_tokens * 2))
        data = snapshot(client, len(tokens))
        client.swa.put(tokens, data)
        redis_server.stop()
        assert client.swa.get(tokens) is None
        assert client.swa.put(tokens, data).failed == 1
        assert client.lookup(tokens, swa_positions=[len(tokens)]).swa_position is None
        stats = client.swa.stats()
        assert stats.backend_errors >= 3 and not stats.backend_up
        blocks = [os.urandom(client.block_bytes) for _ in range(2)]
        assert client.put(tokens, blocks).written_blocks == 2  # global KV is unaffected
        assert client.get(tokens).blocks == blocks
        redis_server.start()  # same port, empty (no persistence), limits forgotten
        assert client.swa.get(tokens) is None
        assert client.swa.put(tokens, data).stored == 1
        assert client.swa.get(tokens) == data
        assert client.lookup(tokens, swa_positions=[len(tokens)]).swa_position == len(tokens)
        with redis.Redis(port=redis_server.port) as raw:
            assert raw.config_get("maxmemory")["maxmemory"] == str(256 << 20)  # applied again


def test_redis_cluster_node_down_gives_misses_not_errors_then_recovers(
        request: pytest.FixtureRequest, start_server: Callable[..., Any], store_settings: StoreSettings,
        redis_cluster: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis-cluster", socket_timeout_s=5.0))
    with Client(server.target) as client:
        keys = [client.swa.key([i]) for i in range(12)]
        data = snapshot(client, 1)
        client.swa.put_many([(k, 1, data) for k in keys])
        node = redis_cluster.nodes[0]
        node.stop()
        try:
            got = client.swa.get_many(keys)
            assert all(g is None or g == data for g in got)
            assert client.swa.stats().backend_errors >= 1
            assert client.put(list(range(client.block_tokens)), [os.urandom(client.block_bytes)]).written_blocks == 1
        finally:
            node.start()
            redis_cluster.wait_ok()
        # The node is back, empty (no persistence): every slot serves again.
        assert client.swa.put_many([(k, 1, data) for k in keys]).stored == len(keys)
        assert client.swa.get_many(keys) == [data] * len(keys)


def test_stats_cli_shows_the_swa_section(client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvstore.cli import main

    client.swa.put([1, 2], snapshot(client, 2))
    client.swa.get([1, 2])
    client.swa.get([3])
    assert main(["stats", "--target", client.target, "--json"]) == 0
    swa = json.loads(capsys.readouterr().out)["swa"]
    assert swa["backend"] == "memory" and swa["hit_rate"] == 0.5 and swa["snapshots_put"] == 1
    assert main(["stats", "--target", client.target]) == 0
    table = capsys.readouterr().out
    assert "SWA pool" in table and "50.0%" in table


def test_a_codec_snapshot_round_trips_through_the_pool(client: Client) -> None:
    import torch

    from kvstore.codec.snapshot import encode_snapshot, split_snapshot

    tokens = list(range(2 * V4_1_FLASH.window + 5))
    window = torch.randn(V4_1_FLASH.num_layers, V4_1_FLASH.window, V4_1_FLASH.head_dim) * 4
    tail = torch.randn(len(V4_1_FLASH.ratio2_source_layers), 2, V4_1_FLASH.head_dim)
    encoded = encode_snapshot(window, tail)
    assert client.swa.put(tokens, encoded).stored == 1
    back = client.swa.get(tokens)
    assert back == encoded
    rows, back_tail = split_snapshot(back, len(tokens))
    assert torch.equal(rows, split_snapshot(encoded, len(tokens))[0])
    assert back_tail is not None and torch.equal(back_tail, tail)
