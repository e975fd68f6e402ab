"""Batched transfers end to end: a real server on loopback, real LMDB, real sealed memfd
regions; each behaviour checked on both paths (shared memory and streamed)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client, TransferSession
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, NotFound
from kvstore.region import Region
from kvstore.transfer import Descriptor, Status

PATHS = ["shm", "stream"]


def stored(client: Client, n: int) -> tuple[list[int], list[bytes]]:
    """A prompt of `n` full blocks, stored."""
    tokens = list(range(1000, 1000 + n * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return tokens, blocks


@pytest.fixture(params=PATHS)
def session(request: Any, client: Client) -> Any:
    with client.transfer(path=request.param) as s:
        yield s


def test_auto_path_maps_regions_on_the_same_host(client: Client) -> None:
    with client.transfer() as s:
        region = s.register(4096)
        assert region.shared and region.region_id > 0
        assert region.name in Path("/proc/self/maps").read_text(), "the server maps the client's memfd"
        assert not (Path("/dev/shm") / region.name).exists(), "a region has no name in any folder"
        with pytest.raises(FailedPrecondition, match="registered already"):
            region.handle  # noqa: B018 - the descriptor is closed once both ends map the region


def test_fetch_lands_blocks_in_the_region(session: TransferSession, client: Client) -> None:
    tokens, blocks = stored(client, 5)
    region = session.register(5 * client.block_bytes)
    state = session.fetch(client.hashes(tokens), region, batch_descriptors=2)
    assert state.done and state.done_prefix == 5 and state.bytes_moved == 5 * client.block_bytes
    assert bytes(region.view) == b"".join(blocks)
    assert region.blocks(client.block_bytes).shape == (5, client.block_bytes)


def test_submit_returns_at_once_and_wait_reports_per_descriptor(session: TransferSession, client: Client) -> None:
    tokens, blocks = stored(client, 2)
    hashes = [*client.hashes(tokens), b"\x07" * 32]
    region = session.register(3 * client.block_bytes)
    size = client.block_bytes
    transfer = session.read([Descriptor(block_hash=h, region_id=region.region_id, offset_bytes=i * size,
                                        length_bytes=size) for i, h in enumerate(hashes)])
    assert transfer.status().transfer_id == transfer.transfer_id
    state = transfer.wait(timeout_s=10)
    assert [r.status for r in state.results] == [Status.DONE, Status.DONE, Status.MISSING]
    assert bytes(region.view[: 2 * size]) == b"".join(blocks)


def test_prefix_only_loads_the_contiguous_found_prefix(session: TransferSession, client: Client) -> None:
    tokens, _ = stored(client, 2)
    hashes = client.hashes(tokens)
    wanted = [hashes[0], b"\x01" * 32, hashes[1]]
    region = session.register(3 * client.block_bytes)
    size = client.block_bytes
    state = session.read([Descriptor(block_hash=h, region_id=region.region_id, offset_bytes=i * size,
                                     length_bytes=size) for i, h in enumerate(wanted)], prefix_only=True).wait()
    assert [r.status for r in state.results] == [Status.DONE, Status.MISSING, Status.SKIPPED]
    assert bytes(region.view[2 * size:]) == bytes(size), "nothing loaded past the prefix"


def test_a_bad_descriptor_fails_alone(session: TransferSession, client: Client) -> None:
    tokens, blocks = stored(client, 3)
    hashes = client.hashes(tokens)
    region = session.register(3 * client.block_bytes)
    size = client.block_bytes
    descs = [
        Descriptor(block_hash=hashes[0], region_id=region.region_id, offset_bytes=0, length_bytes=size),
        Descriptor(block_hash=hashes[1], region_id=region.region_id, offset_bytes=3 * size, length_bytes=size),
        Descriptor(block_hash=hashes[1], region_id=region.region_id, offset_bytes=0, length_bytes=size - 1),
        Descriptor(block_hash=hashes[2], region_id=region.region_id, offset_bytes=2 * size, length_bytes=size),
    ]
    state = session.read(descs).wait()
    assert [r.status for r in state.results] == [Status.DONE, Status.FAILED, Status.FAILED, Status.DONE]
    assert state.results[1].code == "INVALID_ARGUMENT" and "outside region" in state.results[1].reason
    assert "length_bytes" in state.results[2].reason
    assert bytes(region.view[2 * size:]) == blocks[2]


def test_write_stores_blocks_from_the_region(session: TransferSession, client: Client) -> None:
    size = client.block_bytes
    tokens = list(range(7, 7 + 4 * client.block_tokens))
    data = [os.urandom(size) for _ in range(4)]
    region = session.register(4 * size)
    region.view[:] = b"".join(data)
    descs = [Descriptor(region_id=region.region_id, offset_bytes=i * size, length_bytes=size) for i in range(2)]
    state = session.write(tokens, descs).wait()
    assert [r.status for r in state.results] == [Status.DONE] * 2
    assert [r.block_hash for r in state.results] == client.hashes(tokens)[:2]
    rest = [Descriptor(region_id=region.region_id, offset_bytes=i * size, length_bytes=size) for i in (2, 3)]
    assert session.write(tokens, rest, first_block=2).wait().count(Status.DONE) == 2
    assert client.get(tokens).blocks == data


def test_write_without_stored_parent_fails_every_descriptor(session: TransferSession, client: Client) -> None:
    size = client.block_bytes
    tokens = list(range(3 * client.block_tokens))
    region = session.register(size)
    state = session.write(tokens, [Descriptor(region_id=region.region_id, offset_bytes=0, length_bytes=size)],
                          first_block=2).wait()
    assert state.results[0].status is Status.FAILED and state.results[0].code == "FAILED_PRECONDITION"


def test_write_stops_the_chain_at_a_bad_descriptor(session: TransferSession, client: Client) -> None:
    size = client.block_bytes
    tokens = list(range(3 * client.block_tokens))
    region = session.register(2 * size)
    descs = [Descriptor(region_id=region.region_id, offset_bytes=0, length_bytes=size),
             Descriptor(region_id=region.region_id, offset_bytes=2 * size, length_bytes=size),
             Descriptor(region_id=region.region_id, offset_bytes=size, length_bytes=size)]
    state = session.write(tokens, descs).wait()
    assert [r.status for r in state.results] == [Status.DONE, Status.FAILED, Status.FAILED]
    assert "parent block is missing" in state.results[2].reason
    assert client.lookup(tokens).found_blocks == 1


def test_forced_shm_path_refuses_a_region_the_server_cannot_map(client: Client,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A process the server cannot see (as from another host): above Linux's largest pid.
    monkeypatch.setattr(Region, "handle", property(lambda self: ((1 << 22) + 1, 3)))
    with client.transfer(path="shm") as s, pytest.raises(FailedPrecondition, match="cannot map"):
        s.register(4096)
    with client.transfer(path="auto") as s:
        region = s.register(4096)
        assert not region.shared, "auto falls back to the stream path"


def test_unknown_path_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="path must be"):
        client.transfer(path="rdma")


def test_region_tensor_is_a_view_not_a_copy(session: TransferSession) -> None:
    region = session.register(64)
    t = region.tensor()
    t[3] = 9
    assert region.view[3] == 9


@pytest.mark.gpu
def test_region_pins_for_cuda_and_copies_to_the_gpu(session: TransferSession) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    region = session.register(1 << 20)
    region.tensor()[:] = 5
    assert region.pin() and region.pinned
    gpu = region.tensor().cuda(non_blocking=True)
    torch.cuda.synchronize()
    assert int(gpu.sum()) == 5 * (1 << 20)


def test_status_codes_are_the_wire_values() -> None:
    from kvstore.transfer import STATUSES
    from kvstore.v1 import transfer_pb2 as pb

    assert [pb.DescriptorStatus.Value(f"DESCRIPTOR_STATUS_{s.name}") for s in STATUSES] == list(range(len(STATUSES)))


def test_descriptors_group_by_region_and_length_and_a_bad_hash_stands_alone() -> None:
    from kvstore.transfer import Op, group

    h = b"\x01" * 32
    descs = [Descriptor(block_hash=h, region_id=1, offset_bytes=0, length_bytes=8),
             Descriptor(block_hash=h, region_id=1, offset_bytes=8, length_bytes=8),
             Descriptor(block_hash=b"short", region_id=1, offset_bytes=16, length_bytes=8),
             Descriptor(block_hash=h, region_id=1, offset_bytes=24, length_bytes=8),
             Descriptor(block_hash=h, region_id=2, offset_bytes=0, length_bytes=8)]
    assert [len(g) for g in group(descs, Op.READ)] == [2, 1, 1, 1]
    assert [len(g) for g in group(descs, Op.WRITE)] == [4, 1]


def test_fetch_with_a_short_hash_fails_that_descriptor_alone(session: TransferSession, client: Client) -> None:
    tokens, _ = stored(client, 2)
    hashes = client.hashes(tokens)
    region = session.register(3 * client.block_bytes)
    state = session.fetch([hashes[0], b"short", hashes[1]], region, prefix_only=False)
    assert [r.status for r in state.results] == [Status.DONE, Status.FAILED, Status.DONE]
    assert state.results[1].code == "INVALID_ARGUMENT" and "block_hash" in state.results[1].reason
    assert state.count(Status.DONE) == 2 and state.done_prefix == 1


def _bad_calls(session: TransferSession, client: Client) -> list[tuple[str, Callable[[], object]]]:
    """Calls with bad arguments, each by what is wrong with it."""
    size = client.block_bytes
    region = session.register(2 * size)
    rid = region.region_id
    ok = Descriptor(block_hash=b"\1" * 32, region_id=rid, offset_bytes=0, length_bytes=size)
    tokens = list(range(2 * client.block_tokens))
    transfer = session.read([ok])
    with Region(4096) as stranger:
        pass
    return [
        ("register(-5)", lambda: session.register(-5)),
        ("register(0)", lambda: session.register(0)),
        ("register(1.5)", lambda: session.register(1.5)),  # type: ignore[arg-type]
        ("register('4096')", lambda: session.register("4096")),  # type: ignore[arg-type]
        ("Descriptor offset -1", lambda: Descriptor(region_id=rid, offset_bytes=-1, length_bytes=size)),
        ("Descriptor length 2**64", lambda: Descriptor(region_id=rid, offset_bytes=0, length_bytes=2**64)),
        ("Descriptor length 1.0", lambda: Descriptor(region_id=rid, offset_bytes=0, length_bytes=1.0)),  # type: ignore[arg-type]
        ("Descriptor hash str", lambda: Descriptor(block_hash="ab", region_id=rid, offset_bytes=0,  # type: ignore[arg-type]
                                                   length_bytes=size)),
        ("read([])", lambda: session.read([])),
        ("read(dicts)", lambda: session.read([{"region_id": rid}])),  # type: ignore[list-item]
        ("read(one Descriptor)", lambda: session.read(ok)),  # type: ignore[arg-type]
        ("write tokens -5", lambda: session.write([-5] * client.block_tokens, [ok])),
        ("write tokens 2**40", lambda: session.write([2**40] * client.block_tokens, [ok])),
        ("write numpy float tokens", lambda: session.write(np.zeros(client.block_tokens), [ok])),  # type: ignore[arg-type]
        ("write first_block -1", lambda: session.write(tokens, [ok], first_block=-1)),
        ("write too few tokens", lambda: session.write(tokens[:5], [ok])),
        ("write extra key 5", lambda: session.write(tokens, [ok], extra_keys=[5])),  # type: ignore[list-item]
        ("fetch numpy hashes", lambda: session.fetch(np.zeros((2, 32), dtype=np.uint8), region)),  # type: ignore[arg-type]
        ("fetch str hash", lambda: session.fetch(["ab" * 16], region)),  # type: ignore[list-item]
        ("fetch into a numpy array", lambda: session.fetch([b"\1" * 32], np.zeros(size))),  # type: ignore[arg-type]
        ("fetch into another region", lambda: session.fetch([b"\1" * 32], stranger)),
        ("fetch offset -1", lambda: session.fetch([b"\1" * 32], region, offset_bytes=-1)),
        ("fetch past the region", lambda: session.fetch([b"\1" * 32] * 3, region)),
        ("fetch batch 0", lambda: session.fetch([b"\1" * 32], region, batch_descriptors=0)),
        ("fetch prefix_only 'yes'", lambda: session.fetch([b"\1" * 32], region, prefix_only="yes")),  # type: ignore[arg-type]
        ("wait(-1)", lambda: transfer.wait(timeout_s=-1)),
        ("wait(nan)", lambda: transfer.wait(timeout_s=float("nan"))),
        ("wait_all(objects)", lambda: session.wait_all([object()])),  # type: ignore[list-item]
        ("deregister(str)", lambda: session.deregister("region")),  # type: ignore[arg-type]
        ("deregister(stranger)", lambda: session.deregister(stranger)),
        ("transfer(path=5)", lambda: client.transfer(path=5)),  # type: ignore[arg-type]
        ("Region(-1)", lambda: Region(-1)),
        ("blocks(0)", lambda: region.blocks(0)),
        ("blocks count past the end", lambda: region.blocks(size, 3)),
        ("tensor offset past the end", lambda: region.tensor(offset_bytes=3 * size)),
    ]


def test_every_bad_argument_raises_a_kvstore_error(session: TransferSession, client: Client) -> None:
    pytest.importorskip("torch")
    for what, call in _bad_calls(session, client):
        with pytest.raises(KVStoreError) as info:
            call()
        assert isinstance(info.value, InvalidArgument | NotFound), f"{what}: {info.value!r}"
    assert client.stats().blocks_stored == 0, "nothing bad reached the server"


def test_numpy_integers_are_ints(session: TransferSession, client: Client) -> None:
    tokens, blocks = stored(client, 2)
    region = session.register(np.int64(2 * client.block_bytes))  # type: ignore[arg-type]
    state = session.fetch(client.hashes(tokens), region, offset_bytes=np.uint32(0),  # type: ignore[arg-type]
                          batch_descriptors=np.int16(1))  # type: ignore[arg-type]
    assert state.done_prefix == 2 and bytes(region.view) == b"".join(blocks)


def test_a_failure_reason_is_cut_to_its_limit() -> None:
    from kvstore.transfer import MAX_REASON_BYTES, BatchResults

    results = BatchResults(2)
    results.fail(0, "INTERNAL", "é" * 1000)
    results.fail(1, "INTERNAL", "short")
    assert len(results.failures[0][1].encode()) <= MAX_REASON_BYTES and results.failures[0][1].startswith("éé")
    assert results.failures[1][1] == "short"
