"""The bulk transport (docs/TRANSFER.md "Bulk transport"): a real server with real LMDB, and
real Mooncake transfer engines on loopback (the server's and this process's) writing blocks
into client regions; gRPC (`Transfer.Fetch`) as the fallback."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.auth import METHOD_RIGHTS
from kvstore import api_tokens, geometry
from kvstore.client import Client, transfer_bulk
from kvstore.client.transfer import TransferSession
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, TransferSettings
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.transfer import Status
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc
from tests.gateway.test_transfer_fetch import corrupt

TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)
MISSING_ENGINE = ""
try:
    from mooncake.engine import TransferEngine  # noqa: F401
except Exception as exc:  # the package absent, or libibverbs missing
    MISSING_ENGINE = f"mooncake-transfer-engine cannot run here ({exc}); fix: {transfer_bulk.FIX}"

needs_engine = pytest.mark.skipif(bool(MISSING_ENGINE), reason=MISSING_ENGINE)


def _store(tmp_path: Path, blocks: int = 64) -> StoreSettings:
    return StoreSettings(data_dir=tmp_path / "store", capacity_bytes=blocks * BLOCK_BYTES, block_tokens=TOKENS)


@pytest.fixture(params=["map", "staging"])
def source(request: pytest.FixtureRequest) -> str:
    """Where the server's engine writes from: LMDB's map, or (the fallback) a staging slot."""
    return str(request.param)


@pytest.fixture
def bulk_server(start_server: Callable[..., Any], tmp_path: Path, source: str) -> Iterator[tuple[Client, Path]]:
    """A server with `transfer.bulk = "mooncake"` (two blocks a BulkFetch, so fetches take several calls),
    a client, and the server's LMDB file; once writing from the map, once from staging."""
    store = _store(tmp_path)
    server = start_server(store, transfer=TransferSettings(bulk="mooncake", bulk_max_blocks=2,
                                                           bulk_staging_bytes=1 << 20,
                                                           bulk_from_map=source == "map"))
    with Client(server.target) as c:
        yield c, store.data_dir / "data.mdb"


def _fetch(client: Client, path: str, asked: list[bytes], prefix_only: bool, streams: int = 4
           ) -> tuple[list[Any], bytes, str | None]:
    """A fetch's (status, code) per block, the region's bytes, and "" when the bulk transport
    served it to the end (else `bulk_reason`)."""
    with TransferSession(client.connection, path=path, streams=streams) as s:
        region = s.register(len(asked) * BLOCK_BYTES)
        state = s.fetch(asked, region, batch_descriptors=len(asked), prefix_only=prefix_only)
        used = "" if s.bulk is not None else s.bulk_reason
        return [(r.status, r.code) for r in state.results], bytes(region.view), used


@needs_engine
def test_a_bulk_fetch_lands_what_the_grpc_fetch_does(bulk_server: Any) -> None:
    client, data_file = bulk_server
    tokens = list(range(5 * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(5)]
    client.put(tokens, blocks)
    corrupt(data_file, blocks[3])
    hashes = client.hashes(tokens)
    # found, missing, found, found, a bad hash (fails alone, never sent), corrupt (dropped when met)
    asked = [hashes[0], b"\x05" * 32, hashes[1], hashes[2], b"\x06" * 31, hashes[3]]
    statuses, landed, used = _fetch(client, "bulk", asked, False)
    assert used == "", f"the bulk transport was not used: {used}"
    assert statuses == [(Status.DONE, ""), (Status.MISSING, ""), (Status.DONE, ""), (Status.DONE, ""),
                        (Status.FAILED, "INVALID_ARGUMENT"), (Status.FAILED, "DATA_LOSS")]
    assert landed[:BLOCK_BYTES] == blocks[0]
    assert landed[2 * BLOCK_BYTES: 4 * BLOCK_BYTES] == blocks[1] + blocks[2]
    assert landed[BLOCK_BYTES:2 * BLOCK_BYTES] == bytes(BLOCK_BYTES), "a missing block lands nothing"
    assert landed[5 * BLOCK_BYTES:] == bytes(BLOCK_BYTES), "a corrupt block is not landed"
    # The corrupt block was dropped: both paths now see it missing, and agree on everything.
    bulk, grpc_ = _fetch(client, "bulk", asked, False), _fetch(client, "stream", asked, False)
    assert bulk[2] == "" and bulk[:2] == grpc_[:2]
    bulk, grpc_ = _fetch(client, "bulk", asked, True), _fetch(client, "stream", asked, True)
    assert bulk[2] == ""
    assert bulk[0] == grpc_[0] == [(Status.DONE, ""), (Status.MISSING, ""), (Status.SKIPPED, ""),
                                   (Status.SKIPPED, ""), (Status.FAILED, "INVALID_ARGUMENT"), (Status.SKIPPED, "")]
    assert bulk[1][:BLOCK_BYTES] == grpc_[1][:BLOCK_BYTES] == blocks[0]


@needs_engine
def test_a_large_bulk_fetch_over_many_calls_in_flight_lands_every_block(bulk_server: Any, source: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_bulk, "IN_FLIGHT", 4)  # whatever this host's cores
    client, _ = bulk_server
    n = 40
    tokens = list(range(n * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    client.put(tokens, blocks)
    hashes = client.hashes(tokens)
    with TransferSession(client.connection, path="bulk", streams=8) as s:
        region = s.register((n + 1) * BLOCK_BYTES)
        state = s.fetch(hashes, region, offset_bytes=BLOCK_BYTES, batch_descriptors=16)  # 3 batches, 20 calls
        assert s.bulk is not None and state.done_prefix == n and state.bytes_moved == n * BLOCK_BYTES
        stats = client.transfer_stats()
        assert stats.bulk_sessions == 1 and stats.bulk_fetches == 20 and stats.bulk_lanes == transfer_bulk.LANES
        assert stats.bulk_staged == (20 if source == "staging" else 0), "the staged calls, and only those"
        assert bytes(region.view[BLOCK_BYTES:]) == b"".join(blocks)
        # read() returns at once and runs on the path's thread.
        transfer = s.read(_descriptors(hashes[:3], region))
        assert [r.status for r in transfer.wait(30).results] == [Status.DONE] * 3


@needs_engine
def test_calls_past_the_staging_slots_wait_for_one(start_server: Callable[..., Any], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # One slot of 64 blocks (1 MiB of staging): 8 calls in flight take turns in it.
    monkeypatch.setattr(transfer_bulk, "IN_FLIGHT", 8)
    server = start_server(_store(tmp_path), transfer=TransferSettings(bulk="mooncake", bulk_max_blocks=64,
                                                                      bulk_staging_bytes=1 << 20,
                                                                      bulk_from_map=False))
    with Client(server.target) as client:
        n = 48
        tokens = list(range(n * TOKENS))
        blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
        client.put(tokens, blocks)
        with TransferSession(client.connection, path="bulk", streams=8) as s:
            assert s.bulk is not None
            s.bulk.max_blocks = 2  # the client may ask for fewer blocks a call than the server takes
            region = s.register(n * BLOCK_BYTES)
            assert s.fetch(client.hashes(tokens), region).done_prefix == n and s.bulk is not None
            assert bytes(region.view) == b"".join(blocks)
            s.deregister(region)
            assert s.bulk.addresses == {}, "a deregistered region leaves the engine before it is unmapped"
        # The server sees the session's stream end a moment after the client closes it.
        deadline = time.monotonic() + 10
        while client.transfer_stats().bulk_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.transfer_stats().bulk_sessions == 0, "a session's end forgets its engine"


@needs_engine
def test_a_bulk_fetch_reads_only_its_sessions_namespace(bulk_server: Any) -> None:
    client, _ = bulk_server
    tokens = list(range(2 * TOKENS))
    client.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(2)])
    with Client(client.target, namespace="other") as other:
        statuses, landed, used = _fetch(other, "bulk", client.hashes(tokens), False)
    assert used == "" and statuses == [(Status.MISSING, "")] * 2 and landed == bytes(2 * BLOCK_BYTES)


@needs_engine
@pytest.mark.skipif("/kvstore.v1.Transfer/BulkFetch" not in METHOD_RIGHTS,
                    reason="gateway/auth.py does not list OpenBulk and BulkFetch yet (they need 'admin' until it does)")
def test_a_tenant_cannot_bulk_fetch_anothers_blocks(start_server: Callable[..., Any], tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = store.data_dir / "tenants.json"
    store.data_dir.mkdir(parents=True, exist_ok=True)
    a_token = api_tokens.create(path, "tenant-a", frozenset({"read", "write"}))[1]
    b_token = api_tokens.create(path, "tenant-b", frozenset({"read"}))[1]
    server = start_server(store, transfer=TransferSettings(bulk="mooncake"))
    with Client(server.target, token=a_token) as a, Client(server.target, token=b_token) as b:
        tokens = list(range(2 * TOKENS))
        blocks = [os.urandom(BLOCK_BYTES) for _ in range(2)]
        a.put(tokens, blocks)
        assert _fetch(a, "bulk", a.hashes(tokens), False)[1:] == (b"".join(blocks), "")
        statuses, landed, used = _fetch(b, "bulk", a.hashes(tokens), False)
        assert used == "" and statuses == [(Status.MISSING, "")] * 2 and landed == bytes(2 * BLOCK_BYTES)


@needs_engine
def test_r5_a_bulk_fetch_restarts_retention(start_server: Callable[..., Any], tmp_path: Path,
                                            clock: ManualClock, source: str) -> None:
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=8 * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store, transfer=TransferSettings(bulk="mooncake"))
    with Client(server.target) as client:
        a, b = list(range(4 * TOKENS)), list(range(10_000, 10_000 + 4 * TOKENS))
        client.put(a, [os.urandom(BLOCK_BYTES) for _ in range(4)])
        clock.advance(1)
        client.put(b, [os.urandom(BLOCK_BYTES) for _ in range(4)])
        clock.advance(40 * 3600)
        assert _fetch(client, "bulk", client.hashes(a), False)[2] == ""
        clock.advance(40 * 3600)  # b: 80 h since its use; a: 40 h since the bulk fetch
        client.put(list(range(20_000, 20_000 + 4 * TOKENS)), [os.urandom(BLOCK_BYTES) for _ in range(4)])
        assert client.get(a).statuses == ["found"] * 4, "the fetched chain kept its retention window"
        assert client.lookup(b).found_blocks == 0


def _descriptors(hashes: list[bytes], region: Any) -> list[Any]:
    from kvstore.transfer import Descriptor

    return [Descriptor(block_hash=h, region_id=region.region_id, offset_bytes=i * BLOCK_BYTES,
                       length_bytes=BLOCK_BYTES) for i, h in enumerate(hashes)]


def test_a_server_with_bulk_off_refuses_and_the_session_fetches_over_grpc(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_bulk, "_ENGINES", {})
    server = start_server(_store(tmp_path))  # transfer.bulk defaults to "off"
    with Client(server.target) as client:
        tokens = list(range(3 * TOKENS))
        blocks = [os.urandom(BLOCK_BYTES) for _ in range(3)]
        client.put(tokens, blocks)
        statuses, landed, reason = _fetch(client, "bulk", client.hashes(tokens), False)
    assert reason and "offers no bulk transport" in reason, reason
    assert transfer_bulk._ENGINES == {}, "no engine is started here when the server offers none"
    assert statuses == [(Status.DONE, "")] * 3 and landed == b"".join(blocks)


def test_without_mooncake_on_the_client_the_session_says_why_and_streams(
        bulk_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = bulk_server
    # The import fails as it does where the package (or libibverbs) is absent.
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    monkeypatch.setattr(transfer_bulk, "_ENGINES", {})
    tokens = list(range(2 * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(2)]
    client.put(tokens, blocks)
    statuses, landed, reason = _fetch(client, "bulk", client.hashes(tokens), False)
    assert reason and "mooncake-transfer-engine cannot run here" in reason
    assert "pip install mooncake-transfer-engine-non-cuda" in reason
    assert statuses == [(Status.DONE, "")] * 2 and landed == b"".join(blocks)


@needs_engine
def test_a_failing_bulk_fetch_falls_back_to_grpc_and_says_why(bulk_server: Any) -> None:
    client, _ = bulk_server
    tokens = list(range(4 * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(4)]
    client.put(tokens, blocks)
    with TransferSession(client.connection, path="bulk") as s:
        region = s.register(4 * BLOCK_BYTES)
        assert s.bulk is not None
        # The region leaves the engine behind the session's back: the server's write into it fails.
        s.bulk.engine.unregister_memory(s.bulk.addresses[region.region_id])
        state = s.fetch(client.hashes(tokens), region)
        assert s.bulk is None and "BulkFetch failed" in s.bulk_reason and "Unavailable" in s.bulk_reason
        assert state.done_prefix == 4 and bytes(region.view) == b"".join(blocks)


@needs_engine
def test_bad_bulk_requests_answer_clear_statuses(bulk_server: Any) -> None:
    client, _ = bulk_server
    tokens = list(range(TOKENS))
    client.put(tokens, [os.urandom(BLOCK_BYTES)])
    h = client.hashes(tokens)[0]
    stub = pb_grpc.TransferStub(client.connection.channel)
    events = stub.OpenSession(pb.OpenSessionRequest())
    sid = next(events).session_id

    def code(call: Any, request: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        return err.value.code()  # type: ignore[no-any-return]

    fetch = pb.BulkFetchRequest(session_id=sid, block_hashes=h, address=1 << 20, size_bytes=BLOCK_BYTES,
                                offsets_bytes=[0])
    try:
        assert code(stub.BulkFetch, fetch) == grpc.StatusCode.FAILED_PRECONDITION  # no OpenBulk yet
        for segment in ("", "no-port", "host:0", "host:70000", "a b:1", "x" * 300 + ":1"):
            assert code(stub.OpenBulk, pb.OpenBulkRequest(session_id=sid, transport="mooncake",
                                                          segment=segment)) == grpc.StatusCode.INVALID_ARGUMENT
        refused = stub.OpenBulk(pb.OpenBulkRequest(session_id=sid, transport="nixl", segment="127.0.0.1:1"))
        assert not refused.accepted and "only 'mooncake'" in refused.reason
        # The server's engine dials only the host the session's calls come from (here 127.0.0.1).
        for elsewhere in ("10.1.2.3:7000", "[::ffff:10.1.2.3]:7000", "example.com:7000", "localhost:7000"):
            refused = stub.OpenBulk(pb.OpenBulkRequest(session_id=sid, transport="mooncake", segment=elsewhere))
            assert not refused.accepted and "not the address this session's calls come from" in refused.reason
        assert code(stub.OpenBulk, pb.OpenBulkRequest(session_id="f" * 32, transport="mooncake",
                                                      segment="127.0.0.1:1")) == grpc.StatusCode.NOT_FOUND
        opened = stub.OpenBulk(pb.OpenBulkRequest(session_id=sid, transport="mooncake", segment="127.0.0.1:1"))
        assert opened.accepted and opened.max_blocks == 2 and opened.slots >= 1
        bad: dict[str, dict[str, Any]] = {
            "two offsets for one block": {"offsets_bytes": [0, BLOCK_BYTES]},
            "a block past the buffer": {"offsets_bytes": [1]},
            "no address": {"address": 0},
            "a buffer smaller than a block": {"size_bytes": BLOCK_BYTES - 1},
            "more blocks than max_blocks": {"block_hashes": h * 3, "offsets_bytes": [0, 0, 0],
                                            "size_bytes": 4 * BLOCK_BYTES},
            "a hash of 31 bytes": {"block_hashes": h[:31]},
            "an address that wraps": {"address": (1 << 64) - 16},
        }
        for why, fields in bad.items():
            request = pb.BulkFetchRequest()
            request.CopyFrom(fetch)
            for name, value in fields.items():
                if name == "offsets_bytes":
                    del request.offsets_bytes[:]
                    request.offsets_bytes.extend(value)
                else:
                    setattr(request, name, value)
            assert code(stub.BulkFetch, request) == grpc.StatusCode.INVALID_ARGUMENT, why
        # Nothing listens at 127.0.0.1:1: the engine's write fails, the call says so (the client falls back).
        assert code(stub.BulkFetch, fetch) == grpc.StatusCode.UNAVAILABLE
    finally:
        events.cancel()


@needs_engine
def test_the_staging_pool_stays_within_bulk_staging_bytes(start_server: Callable[..., Any], tmp_path: Path) -> None:
    # 512 blocks a call would be 7 MiB a slot: the server offers fewer, so one slot fits in 1 MiB.
    server = start_server(_store(tmp_path), transfer=TransferSettings(bulk="mooncake", bulk_max_blocks=512,
                                                                      bulk_staging_bytes=1 << 20))
    with Client(server.target) as client:
        stub = pb_grpc.TransferStub(client.connection.channel)
        events = stub.OpenSession(pb.OpenSessionRequest())
        try:
            sid = next(events).session_id
            opened = stub.OpenBulk(pb.OpenBulkRequest(session_id=sid, transport="mooncake", segment="127.0.0.1:1"))
        finally:
            events.cancel()
    # A slot is counted in the largest block of the geometries served (an engine's layout: kvstore.layout).
    largest = max(g.block_bytes(TOKENS) for g in geometry.REGISTRY.values())
    assert largest > BLOCK_BYTES and opened.accepted and opened.slots * opened.max_blocks * largest <= 1 << 20
    assert opened.max_blocks == (1 << 20) // largest and opened.slots == 1


def test_the_segment_host_is_compared_by_address() -> None:
    from gateway.transfer_bulk_lanes import peer_host, same_host

    assert peer_host("ipv4:10.0.0.5:4242") == "10.0.0.5" and peer_host("ipv6:[::1]:4242") == "::1"
    assert peer_host("unix:/tmp/s") == ""
    assert same_host("10.0.0.5", peer_host("ipv6:[::ffff:10.0.0.5]:4242"))  # a dual-stack listener's view
    assert same_host("127.0.0.1", "::1") and not same_host("10.0.0.6", "10.0.0.5")
    assert not same_host("host.example", "10.0.0.5") and not same_host("10.0.0.5", "")


def test_bad_bulk_settings_and_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"transfer\.bulk"):
        TransferSettings(bulk="rdma")
    with pytest.raises(ConfigError, match="bulk_max_blocks"):
        TransferSettings(bulk_max_blocks=4096)
    with pytest.raises(InvalidArgument, match="bulk"):
        TransferSession(None, path="bulky")  # type: ignore[arg-type]
