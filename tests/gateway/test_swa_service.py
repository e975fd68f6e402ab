"""The SwaPool service end to end: a real gRPC server over each real backend, and its faults."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import redis

from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, SwaSettings
from kvstore.errors import InvalidArgument
from kvstore.prefix import BlockScope
from kvstore.swa_snapshot import seal
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc


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


def snapshot(client: Client) -> bytes:
    return os.urandom(client.swa.snapshot_bytes)


def test_put_get_delete_round_trip(swa_client: Client) -> None:
    swa = swa_client.swa
    tokens = list(range(100))
    prompt_end, output_end = snapshot(swa_client), snapshot(swa_client)
    assert swa.put(tokens[:60], prompt_end).stored == 1
    assert swa.put(tokens, output_end).stored == 1
    assert swa.get(tokens[:60]) == prompt_end
    assert swa.get(tokens, 60) == prompt_end  # the same point named by position
    assert swa.get(tokens) == output_end
    assert swa.get(tokens, 59) is None
    assert swa.delete_many([swa.key(tokens)]) == 1
    assert swa.get(tokens) is None
    stats = swa.stats()
    assert stats.backend_up and stats.snapshots_put == 2 and stats.hits == 3 and stats.snapshots_asked == 5


def test_lookup_names_the_greatest_usable_snapshot(swa_client: Client) -> None:
    b = swa_client.block_tokens
    tokens = list(range(4 * b + 5))
    swa_client.put(tokens[: 2 * b], [os.urandom(swa_client.block_bytes) for _ in range(2)])
    for p in (b, 2 * b + 3, 4 * b + 5):
        swa_client.swa.put(tokens, snapshot(swa_client), position=p)
    candidates = [b, 2 * b, 2 * b + 3, 3 * b, 4 * b + 5]
    found = swa_client.lookup(tokens, swa_positions=candidates)
    # 4b+5 has a snapshot but blocks 2-3 are not stored: not usable. 2b+3 is inside the next block.
    assert found.found_tokens == 2 * b and found.swa_position == 2 * b + 3
    assert swa_client.lookup(tokens, swa_positions=[3 * b]).swa_position is None
    assert swa_client.lookup(tokens).swa_position is None
    short = tokens[:5]
    swa_client.swa.put(short, snapshot(swa_client))
    assert swa_client.lookup(short, swa_positions=[5]).swa_position == 5  # no full block at all


def test_wrong_size_or_checksum_is_rejected_on_put(swa_client: Client) -> None:
    swa = swa_client.swa
    with pytest.raises(InvalidArgument, match="SWA snapshot is"):
        swa.put([1, 2, 3], b"x" * (swa.snapshot_bytes - 1))
    stub = pb_grpc.SwaPoolStub(swa_client._channel)
    data = snapshot(swa_client)
    bad = pb.SwaPutRequest(snapshots=[pb.SwaSnapshot(key=swa.key([1, 2, 3]), data=data, checksum=1)])
    with pytest.raises(grpc.RpcError) as info:
        stub.Put(bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in (info.value.details() or "")
    with pytest.raises(InvalidArgument, match="unknown geometry"):
        swa_client._call(stub.Put, pb.SwaPutRequest(geometry="other", snapshots=bad.snapshots))
    assert swa.get([1, 2, 3]) is None


def test_memory_pool_expires_by_the_injected_clock(start_server: Callable[..., Any], store_settings: StoreSettings,
                                                  clock: ManualClock) -> None:
    server = start_server(store_settings, swa=SwaSettings(ttl_s=120, cap_bytes=64 << 20))
    with Client(server.target) as client:
        client.swa.put([1, 2, 3], snapshot(client))
        client.swa.put([4, 5, 6], snapshot(client), ttl_s=10)  # shorter than the operator's TTL
        clock.advance(11)
        assert client.swa.get([4, 5, 6]) is None and client.swa.get([1, 2, 3]) is not None
        assert client.swa.put([7], snapshot(client), ttl_s=9999).ttl_ms == 120_000  # never longer
        clock.advance(110)
        assert client.swa.get([1, 2, 3]) is None
        stats = client.swa.stats()
        assert stats.expirations == 2 and stats.backend_errors == 0


def test_redis_expiry_is_a_miss_on_the_real_server(request: pytest.FixtureRequest, start_server: Callable[..., Any],
                                                   store_settings: StoreSettings) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis", ttl_s=1.0))
    with Client(server.target) as client:
        client.swa.put([1, 2, 3], snapshot(client))
        assert client.swa.get([1, 2, 3]) is not None
        time.sleep(1.5)
        assert client.swa.get([1, 2, 3]) is None
        stats = client.swa.stats()
        assert stats.expirations >= 1 and stats.backend_errors == 0


def test_redis_limits_are_set_at_connect(request: pytest.FixtureRequest, start_server: Callable[..., Any],
                                         store_settings: StoreSettings, redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis", cap_bytes=100 << 20))
    with Client(server.target) as client, redis.Redis(port=redis_server.port) as raw:
        client.swa.put([1], snapshot(client))
        assert raw.config_get("maxmemory")["maxmemory"] == str(100 << 20)
        assert raw.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        assert 0 < raw.pttl(b"kvstore:swa:" + BlockScope(client.fingerprint, "default").key(client.swa.key([1]))) \
            <= 300_000
        assert client.swa.stats().cap_bytes == 100 << 20


def test_corrupt_or_foreign_record_is_a_counted_miss(request: pytest.FixtureRequest,
                                                     start_server: Callable[..., Any],
                                                     store_settings: StoreSettings, redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis"))
    with Client(server.target) as client, redis.Redis(port=redis_server.port) as raw:
        data = snapshot(client)
        client.swa.put([1], data)
        client.swa.put([2], data)
        scope = BlockScope(client.fingerprint, "default")
        k1 = b"kvstore:swa:" + scope.key(client.swa.key([1]))
        k2 = b"kvstore:swa:" + scope.key(client.swa.key([2]))
        record = bytearray(raw.get(k1) or b"")
        record[1000] ^= 0xFF
        raw.set(k1, bytes(record))
        raw.set(k2, seal(b"\x01" * 8, data, 0))  # another geometry's header
        assert client.swa.get_many([client.swa.key([1]), client.swa.key([2])]) == [None, None]
        assert client.swa.stats().corrupt == 2


def test_redis_down_gives_misses_and_kv_keeps_serving_then_recovers(
        request: pytest.FixtureRequest, start_server: Callable[..., Any], store_settings: StoreSettings,
        redis_server: Any) -> None:
    server = start_server(store_settings, swa=swa_settings(request, "redis", socket_timeout_s=0.5))
    with Client(server.target) as client:
        tokens = list(range(client.block_tokens * 2))
        data = snapshot(client)
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
    server = start_server(store_settings, swa=swa_settings(request, "redis-cluster", socket_timeout_s=0.5))
    with Client(server.target) as client:
        keys = [client.swa.key([i]) for i in range(12)]
        data = snapshot(client)
        client.swa.put_many([(k, data) for k in keys])
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
        assert client.swa.put_many([(k, data) for k in keys]).stored == len(keys)
        assert client.swa.get_many(keys) == [data] * len(keys)


def test_stats_cli_shows_the_swa_section(client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvstore.cli import main

    client.swa.put([1, 2], snapshot(client))
    client.swa.get([1, 2])
    client.swa.get([3])
    assert main(["stats", "--target", client.target, "--json"]) == 0
    swa = json.loads(capsys.readouterr().out)["swa"]
    assert swa["backend"] == "memory" and swa["hit_rate"] == 0.5 and swa["snapshots_put"] == 1
    assert main(["stats", "--target", client.target]) == 0
    table = capsys.readouterr().out
    assert "SWA pool" in table and "50.0%" in table


def test_fp8_snapshot_tensor_round_trips_through_the_pool(client: Client) -> None:
    import torch

    from kvstore.codec import fp8
    from kvstore.geometry import V4_1_FLASH

    tokens = list(range(2 * client.block_tokens + 5))
    window = torch.randn(V4_1_FLASH.swa_layers, V4_1_FLASH.swa_window_tokens, V4_1_FLASH.swa_channels) * 4
    encoded = fp8.encode_snapshot(V4_1_FLASH, window)
    assert client.swa.put(tokens, encoded).stored == 1
    back = client.swa.get(tokens)
    assert back is not None and back == encoded.numpy().tobytes()
    assert torch.equal(fp8.decode_snapshot(V4_1_FLASH, back), fp8.decode_snapshot(V4_1_FLASH, encoded))
