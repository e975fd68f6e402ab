"""The path across hosts: `Transfer.Fetch`, striped by the client over several calls at
once (docs/TRANSFER.md, "Cross-host fetch"), on a real server with real LMDB."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore import api_tokens
from kvstore.client import Client, transfer_stream
from kvstore.client.transfer import TransferSession
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.transfer import DONE, FAILED, MISSING, Descriptor, Op, Status, group
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc
from tests.damage import corrupt

TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)
HOUR = 3600.0


@pytest.fixture
def small(start_server: Callable[..., Any], tmp_path: Path) -> Iterator[tuple[Any, Client, Path]]:
    """A server whose store holds two chains of 4 blocks, a client, and its LMDB file."""
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=8 * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store)
    with Client(server.target) as c:
        yield server, c, store.data_dir / "data.mdb"


def chain(client: Client, n: int) -> tuple[list[bytes], list[bytes]]:
    """A chain of n random blocks stored: their hashes and bytes."""
    tokens = list(range(n * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


def test_a_striped_fetch_lands_what_one_stream_does(small: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, client, data_file = small
    tokens = list(range(5 * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(5)]
    client.put(tokens, blocks)
    corrupt(data_file, blocks[3])
    hashes = client.hashes(tokens)
    # The corrupt block last: a read that meets it drops it (and its descendants) at once.
    asked = [hashes[0], b"\x05" * 32, hashes[1], hashes[2], b"\x06" * 31, hashes[3]]
    monkeypatch.setattr(transfer_stream, "STRIPE_BLOCKS", 2)  # three stripes, in flight together
    monkeypatch.setattr(transfer_stream, "MAX_STRIPE_BLOCKS", 2)

    def fetch(streams: int, prefix_only: bool) -> tuple[list[Any], bytes]:
        with TransferSession(client.connection, path="stream", streams=streams) as s:
            region = s.register(len(asked) * BLOCK_BYTES)
            state = s.fetch(asked, region, batch_descriptors=len(asked), prefix_only=prefix_only)
            return [(r.status, r.code) for r in state.results], bytes(region.view)

    statuses, landed = fetch(4, False)
    assert statuses == [(Status.DONE, ""), (Status.MISSING, ""), (Status.DONE, ""), (Status.DONE, ""),
                        (Status.FAILED, "INVALID_ARGUMENT"), (Status.FAILED, "DATA_LOSS")]
    assert landed[:BLOCK_BYTES] == blocks[0]
    assert landed[2 * BLOCK_BYTES: 4 * BLOCK_BYTES] == blocks[1] + blocks[2]
    assert landed[5 * BLOCK_BYTES:] == bytes(BLOCK_BYTES), "a corrupt block is not landed"
    for prefix_only in (False, True):
        one, many = fetch(1, prefix_only), fetch(4, prefix_only)
        assert many == one
    assert fetch(4, True)[0] == [(Status.DONE, ""), (Status.MISSING, ""), (Status.SKIPPED, ""), (Status.SKIPPED, ""),
                                 (Status.FAILED, "INVALID_ARGUMENT"), (Status.SKIPPED, "")]


def test_the_stream_count_is_range_checked(small: Any) -> None:
    _, client, _ = small
    bad_counts: list[Any] = [0, transfer_stream.MAX_STREAMS + 1, True, 2.0, "4"]
    for bad in bad_counts:
        with pytest.raises(InvalidArgument, match="streams"):
            TransferSession(client.connection, path="stream", streams=bad)
    with TransferSession(client.connection, path="stream") as s:
        assert 2 <= s.streams <= 8
    with TransferSession(client.connection, path="stream", streams=transfer_stream.MAX_STREAMS) as s:
        assert s.streams == transfer_stream.MAX_STREAMS


def test_a_fetch_is_checked_whole(small: Any) -> None:
    _, client, _ = small
    stub = pb_grpc.TransferStub(client.connection.channel)
    for hashes, words in ((b"", "1 or more"), (b"\x01" * 33, "33 bytes"), (b"\x01" * 32 * 5000, "at most")):
        with pytest.raises(grpc.RpcError) as info:
            stub.Fetch(pb.FetchRequest(block_hashes=hashes))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (info.value.details() or "")


def test_r5_a_fetch_restarts_retention(small: Any, clock: ManualClock) -> None:
    _, client, _ = small
    a, b = list(range(4 * TOKENS)), list(range(10_000, 10_000 + 4 * TOKENS))
    client.put(a, [os.urandom(BLOCK_BYTES) for _ in range(4)])
    clock.advance(1)
    client.put(b, [os.urandom(BLOCK_BYTES) for _ in range(4)])
    clock.advance(40 * HOUR)
    with TransferSession(client.connection, path="stream") as s:
        region = s.register(4 * BLOCK_BYTES)
        assert s.fetch(client.hashes(a), region).done_prefix == 4
    clock.advance(40 * HOUR)  # b: 80 h since its use; a: 40 h since the fetch
    client.put(list(range(20_000, 20_000 + 4 * TOKENS)), [os.urandom(BLOCK_BYTES) for _ in range(4)])
    assert client.get(a).statuses == ["found"] * 4, "the fetched chain kept its retention window"
    assert client.lookup(b).found_blocks == 0


def test_a_tenant_cannot_fetch_or_read_anothers(start_server: Callable[..., Any],
                                                 store_settings: StoreSettings) -> None:
    path = store_settings.data_dir / "tenants.json"
    rw = frozenset({"read", "write"})
    a_token = api_tokens.create(path, "tenant-a", rw)[1]
    b_token = api_tokens.create(path, "tenant-b", rw)[1]
    server = start_server(store_settings)
    with Client(server.target, token=a_token) as a, Client(server.target, token=b_token) as b:
        tokens = list(range(2 * a.block_tokens))
        a.put(tokens, [os.urandom(a.block_bytes) for _ in range(2)])
        hashes = a.hashes(tokens)
        stub = pb_grpc.TransferStub(b.connection.channel)
        # Another tenant's blocks miss as unknown ones do; naming its namespace is refused.
        theirs = stub.Fetch(pb.FetchRequest(block_hashes=b"".join(hashes)), metadata=b.connection.metadata)
        assert theirs.statuses == bytes([2, 2]) and not theirs.data
        with pytest.raises(grpc.RpcError) as info:
            stub.Fetch(pb.FetchRequest(namespace="tenant-a", block_hashes=hashes[0]), metadata=b.connection.metadata)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The fast path (one batch, Submit with wait) keeps another tenant's region unknown.
        with a.transfer() as sa, b.transfer() as sb:
            region = sa.register(a.block_bytes)
            batch = group([Descriptor(block_hash=hashes[0], region_id=region.region_id, offset_bytes=0,
                                      length_bytes=b.block_bytes)], Op.READ)
            state = sb._paths["shm"].read_many([batch], False)[0].wait()
            assert [r.code for r in state.results] == ["NOT_FOUND"]
            assert bytes(region.view) == bytes(a.block_bytes)


def _counting(stream: Any) -> list[int]:
    calls: list[int] = []
    original = stream.fetch_slots

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    stream.fetch_slots = counted
    return calls


def test_a_one_stripe_fetch_lands_what_the_striped_path_does(small: Any) -> None:
    # fetch of one stripe's worth into a local region is one Fetch call landed without spans
    # (StreamPath.fetch_slots); it must land and report exactly what read_many does.
    _, client, data_file = small
    hashes, blocks = chain(client, 4)
    asked = [hashes[0], b"\x05" * 32, hashes[1], hashes[2]]
    for prefix_only in (False, True):
        with TransferSession(client.connection, path="stream") as s:
            stream = s._paths["stream"]
            calls = _counting(stream)
            fast_region, slow_region = s.register(5 * BLOCK_BYTES), s.register(5 * BLOCK_BYTES)
            fast = s.fetch(asked, fast_region, offset_bytes=BLOCK_BYTES, prefix_only=prefix_only)
            assert calls == [1]
            descs = [Descriptor(block_hash=h, region_id=slow_region.region_id, offset_bytes=(i + 1) * BLOCK_BYTES,
                                length_bytes=BLOCK_BYTES) for i, h in enumerate(asked)]
            slow = stream.read_many([group(descs, Op.READ)], prefix_only)[0].wait()
            assert (fast.statuses, fast.bytes_moved, dict(fast.failures)) == \
                (slow.statuses, slow.bytes_moved, dict(slow.failures))
            assert bytes(fast_region.view) == bytes(slow_region.view)
            assert bytes(fast_region.view[BLOCK_BYTES:2 * BLOCK_BYTES]) == blocks[0]
            expected = [Status.DONE, Status.MISSING] + ([Status.SKIPPED] * 2 if prefix_only else [Status.DONE] * 2)
            assert [r.status for r in fast.results] == expected
    # A corrupt block: FAILED with DATA_LOSS and never landed, the blocks after it landed in their slots.
    corrupt(data_file, blocks[1])
    with TransferSession(client.connection, path="stream") as s:
        calls = _counting(s._paths["stream"])
        region = s.register(3 * BLOCK_BYTES)
        state = s.fetch([hashes[0], hashes[1], hashes[0]], region, prefix_only=False)
        assert calls == [1]
        assert [(r.status, r.code) for r in state.results] == [(Status.DONE, ""), (Status.FAILED, "DATA_LOSS"),
                                                              (Status.DONE, "")]
        assert bytes(region.view) == blocks[0] + bytes(BLOCK_BYTES) + blocks[0]


def test_a_fetch_reply_is_the_message_protobuf_would_send(small: Any) -> None:
    # The server answers Fetch with bytes it serialized itself (blocks copied straight into them);
    # any protobuf client must read the same message, whole or with misses and failures.
    _, client, data_file = small
    hashes, blocks = chain(client, 3)
    stub = pb_grpc.TransferStub(client.connection.channel)
    raw = client.connection.channel.unary_unary("/kvstore.v1.Transfer/Fetch",
                                                request_serializer=pb.FetchRequest.SerializeToString)

    def both(asked: list[bytes]) -> tuple[pb.FetchReply, bytes]:
        request = pb.FetchRequest(block_hashes=b"".join(asked))
        return stub.Fetch(request), raw(request)

    whole, wire = both(hashes)
    assert whole == pb.FetchReply(statuses=bytes([DONE] * 3), data=b"".join(blocks))
    assert wire == whole.SerializeToString(), "the same bytes protobuf would write"
    corrupt(data_file, blocks[2])  # read once: the read drops it, so only this call sees it corrupt
    mixed = pb.FetchReply.FromString(raw(pb.FetchRequest(block_hashes=b"".join(
        [hashes[1], b"\x07" * 32, hashes[0], hashes[2]]))))
    assert mixed.statuses == bytes([DONE, MISSING, DONE, FAILED])
    assert mixed.data == blocks[1] + blocks[0], "only the DONE blocks travel, in order"
    assert [(f.index, f.code) for f in mixed.failures] == [(3, "DATA_LOSS")]


def test_a_fetch_is_cut_into_enough_calls_of_16_to_64_blocks() -> None:
    stripe = transfer_stream.stripe_blocks
    assert stripe(4096, 8, 1000) == 64, "a large fetch: the largest calls"
    assert stripe(200, 4, 1000) == 50, "enough calls to keep every stream busy"
    assert stripe(64, 8, 1000) == 16 and stripe(5, 8, 1000) == 16, "never smaller than 16 blocks a call"
    assert stripe(4096, 8, 40) == 40 and stripe(4096, 8, 0) == 1, "within the server's limits"
    # Bounded in bytes: 256-token blocks (4x the 64-token ones) go 4 to 16 a call; smaller blocks as before.
    big = 4 * transfer_stream.STRIPE_REFERENCE_BYTES
    assert stripe(4096, 8, 1000, big) == 16 and stripe(5, 8, 1000, big) == 4 and stripe(40, 4, 1000, big) == 10
    assert stripe(4096, 8, 1000, 1024) == 64 and stripe(5, 8, 1000, 1024) == 16
    assert stripe(4096, 8, 1000, 100 * transfer_stream.STRIPE_REFERENCE_BYTES) == 1, "at least one block"


def test_a_large_fetch_goes_out_in_large_calls(start_server: Callable[..., Any], tmp_path: Path) -> None:
    server = start_server(StoreSettings(data_dir=tmp_path / "store", capacity_bytes=64 * BLOCK_BYTES,
                                        block_tokens=TOKENS))
    with Client(server.target) as client, TransferSession(client.connection, path="stream", streams=1) as s:
        hashes, blocks = chain(client, 40)
        stream: Any = s._paths["stream"]
        sizes: list[int] = []
        send = stream._reply_for

        def counted(fn: Any, block_hashes: bytes, prefix_only: bool) -> Any:
            sizes.append(len(block_hashes) // 32)
            return send(fn, block_hashes, prefix_only)

        stream._reply_for = counted
        region = s.register(40 * BLOCK_BYTES)
        assert s.fetch(hashes, region).done_prefix == 40
        assert bytes(region.view) == b"".join(blocks)
    assert sizes == [40], "one call of 40 blocks with one stream in flight, not 16-block ones"
