"""The run index (tiers/run_index.py) and the Fleet service's copies (gateway/fleet_servicer.py), docs/FLEET.md F16-F20.

Real LMDB stores in temp dirs and a real gRPC server on loopback serving the Fleet
service over one of them; blocks are stored through the tier's own Put path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash

from gateway.fleet_servicer import TOKEN_METADATA, add_fleet_service
from kvstore.clock import ManualClock
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings, StoreSettings
from kvstore.errors import ConfigError
from kvstore.geometry import TINY
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tests.conftest import LoopThread
from tiers import run_index
from tiers.lmdb_tier import LmdbBlockTier

TOKENS = 16
RUN_BLOCKS = 4
BLOCK = TINY.block_bytes(TOKENS)
SCOPE = BlockScope(TINY.fingerprint, "default")
TOKEN = b"a-fleet-token-of-enough-bytes"


@dataclass
class Node:
    """A store with the run index on, served by the Fleet service on loopback."""

    tier: LmdbBlockTier
    stub: fleet_pb2_grpc.FleetStub
    server: Any
    channel: Any


def chain(n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    tokens = [seed * 100_000 + i for i in range(n * TOKENS)]
    return (chain_hashes(tokens, block_tokens=TOKENS, parent=root_hash(TINY.fingerprint, TOKENS)),
            [os.urandom(BLOCK) for _ in range(n)])


def put(tier: LmdbBlockTier, hashes: list[bytes], blocks: list[bytes], start: int = 0) -> None:
    parent = root_hash(TINY.fingerprint, TOKENS) if start == 0 else hashes[start - 1]
    tier.put(SCOPE, parent, hashes[start:], blocks[start:], start == 0)


@pytest.fixture
def nodes(tmp_path: Path, loop_thread: LoopThread) -> Iterator[Any]:
    made: list[Node] = []
    clock = ManualClock()
    token_file = tmp_path / "fleet-token"
    token_file.write_bytes(TOKEN + b"\n")

    def make(name: str, *, auth_on: bool = False) -> Node:
        store = StoreSettings(data_dir=tmp_path / name, capacity_bytes=1 << 28, block_tokens=TOKENS)
        settings = Settings(store=store, fleet=FleetSettings(run_blocks=RUN_BLOCKS, token_file=str(token_file)))
        tier = LmdbBlockTier(store, clock=clock)

        async def serve() -> tuple[Any, Any, int]:
            server = grpc.aio.server()
            add_fleet_service(server, settings, tier, auth_on=lambda: auth_on)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"), port

        server, channel, _ = loop_thread.run(serve())
        node = Node(tier=tier, stub=fleet_pb2_grpc.FleetStub(channel), server=server, channel=channel)
        made.append(node)
        return node

    yield make
    for n in made:
        loop_thread.run(n.channel.close())
        loop_thread.run(n.server.stop(0))
        n.tier.close()


def copies(tier: LmdbBlockTier, keys: list[bytes]) -> list[pb.CopiedBlock]:
    out = []
    for key, (_, data) in zip(keys, tier.read(keys), strict=True):
        found = [b for b in run_index.members(tier.env, key, 1 << 20) if b.key == key]
        meta = found[0].meta if found else None
        assert meta is not None
        out.append(pb.CopiedBlock(key=key, namespace="default", parent_hash=meta.parent_hash, depth=meta.depth,
                                  data=data, checksum=meta.checksum, last_use_s=meta.last_access_s))
    return out


def metas(tier: LmdbBlockTier, keys: list[bytes]) -> list[Any]:
    from tiers.block_txn import read_meta

    with tier.env.begin() as txn:
        return [read_meta(txn, tier._dbs, k) for k in keys]


def call(loop_thread: LoopThread, rpc: Any, request: Any, token: bytes | None = TOKEN) -> Any:
    metadata = ((TOKEN_METADATA, token.decode()),) if token else ()

    async def go() -> Any:
        return await rpc(request, metadata=metadata)

    return loop_thread.run(go())


def test_f16_the_run_index_names_each_run_root_stored(nodes: Any) -> None:
    a = nodes("a")
    hashes, blocks = chain(10)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    runs = run_index.list_runs(a.tier.env)
    assert sorted((r.key, r.first_block) for r in runs) == sorted((keys[i], i) for i in (0, 4, 8))
    assert [b.key for b in run_index.members(a.tier.env, keys[4], RUN_BLOCKS)] == keys[4:8]
    assert [b.key for b in run_index.members(a.tier.env, keys[8], RUN_BLOCKS)] == keys[8:10]


def test_f16_an_evicted_run_root_leaves_the_index(nodes: Any) -> None:
    a = nodes("a")
    hashes, blocks = chain(6)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    a.tier.purge(SCOPE, [hashes[4]])  # the second run (blocks 4, 5) and nothing above it
    assert sorted(r.key for r in run_index.list_runs(a.tier.env)) == [keys[0]]
    a.tier.purge(SCOPE, None)
    assert run_index.list_runs(a.tier.env) == []


def test_f16_a_store_that_held_blocks_before_the_fleet_is_indexed(tmp_path: Path) -> None:
    store = StoreSettings(data_dir=tmp_path / "s", capacity_bytes=1 << 28, block_tokens=TOKENS)
    tier = LmdbBlockTier(store)
    try:
        hashes, blocks = chain(9)
        put(tier, hashes, blocks)
        assert run_index.list_runs(tier.env) == []  # a single node keeps no index
        assert run_index.enable(tier.env, RUN_BLOCKS) == 3
        assert {r.first_block for r in run_index.list_runs(tier.env)} == {0, 4, 8}
        assert run_index.enable(tier.env, RUN_BLOCKS) == 0  # kept from now on: not rebuilt again
    finally:
        tier.close()


def test_f17_a_run_is_copied_to_a_node_without_the_run_before_it(nodes: Any, loop_thread: LoopThread) -> None:
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(8)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    reply = call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=copies(a.tier, keys[4:8])))
    assert (reply.written_blocks, reply.existing_blocks) == (4, 0)
    assert [data for _, data in b.tier.read(keys[4:8])] == blocks[4:8]
    assert [m.depth for m in metas(b.tier, keys[4:8])] == [5, 6, 7, 8]
    assert [r.first_block for r in run_index.list_runs(b.tier.env)] == [4]
    digests = call(loop_thread, b.stub.RunDigests, pb.RunDigestsRequest(run_roots=[keys[4], keys[0]]))
    theirs = call(loop_thread, a.stub.RunDigests, pb.RunDigestsRequest(run_roots=[keys[4]]))
    assert digests.runs[0] == theirs.runs[0] and digests.runs[0].blocks == 4
    assert digests.runs[1].blocks == 0
    held = call(loop_thread, b.stub.HeldBlocks, pb.HeldBlocksRequest(keys=keys))
    assert list(held.held) == [False] * 4 + [True] * 4
    # The first run arriving later joins them into one chain, as a Put would have.
    call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=copies(a.tier, keys[:4])))
    assert b.tier.lookup(SCOPE, hashes)[0] == 8


def test_f17_a_block_inside_a_run_needs_its_parent(nodes: Any, loop_thread: LoopThread) -> None:
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(8)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=copies(a.tier, keys[5:7])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not stored" in err.value.details()
    assert not any(call(loop_thread, b.stub.HeldBlocks, pb.HeldBlocksRequest(keys=keys)).held)


def test_f17_a_copy_that_fails_its_checksum_is_refused_and_nothing_is_stored(nodes: Any,
                                                                             loop_thread: LoopThread) -> None:
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(4)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    sent = copies(a.tier, keys)
    flipped = bytearray(sent[2].data)
    flipped[7] ^= 0xFF
    sent[2].data = bytes(flipped)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=sent))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "checksum" in err.value.details()
    assert not any(call(loop_thread, b.stub.HeldBlocks, pb.HeldBlocksRequest(keys=keys)).held)


def test_f17_a_copy_is_checked_like_a_put(nodes: Any, loop_thread: LoopThread) -> None:
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(1)
    put(a.tier, hashes, blocks)
    [good] = copies(a.tier, [SCOPE.key(hashes[0])])
    short = pb.CopiedBlock(); short.CopyFrom(good); short.data = good.data[:-1]  # noqa: E702
    short.checksum = xxhash.xxh3_64_intdigest(short.data)
    other = pb.CopiedBlock(); other.CopyFrom(good); other.namespace = "someone-else"  # noqa: E702
    for bad, words in ((short, "bytes; its geometry's blocks are"), (other, "not the one its key names")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=[bad]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


def test_f17_a_copy_is_stored_with_the_checksums_its_check_verified(nodes: Any, loop_thread: LoopThread,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver hashes each copied block once (its check, F17) and stores that checksum: the store's writer,
    LMDB's one writer and the copy's bottleneck, does not hash the bytes again inside its transaction."""
    from kvstore.native import blockcopy

    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(6)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    sent = copies(a.tier, keys)

    def hashed_again(datas: Any) -> Any:
        raise AssertionError("a copied block was hashed again by the store")

    monkeypatch.setattr(blockcopy, "digests", hashed_again)
    reply = call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=sent))
    assert reply.written_blocks == 6
    assert [m.checksum for m in metas(b.tier, keys)] == [xxhash.xxh3_64_intdigest(d) for d in blocks]
    assert [data for _, data in b.tier.read(keys)] == blocks  # the verified read (R3) takes the stored sums


def test_f19_a_copy_keeps_the_later_last_use(nodes: Any, loop_thread: LoopThread) -> None:
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(2)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    sent = copies(a.tier, keys)
    now = a.tier.retention_clock.now()
    sent[0].last_use_s, sent[1].last_use_s = now - 3600, now - 7200
    call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=sent))
    assert [m.last_access_s for m in metas(b.tier, keys)] == [now - 3600, now - 7200]  # the source's, not now
    sent[1].last_use_s = now - 60  # a later use on another copy raises it; an earlier one never lowers it
    sent[0].last_use_s = now - 9000
    reply = call(loop_thread, b.stub.CopyBlocks, pb.CopyBlocksRequest(blocks=sent))
    assert reply.existing_blocks == 2
    assert [m.last_access_s for m in metas(b.tier, keys)] == [now - 3600, now - 60]


def test_f20_fleet_calls_need_the_fleet_token(nodes: Any, loop_thread: LoopThread) -> None:
    b = nodes("b", auth_on=True)
    request = pb.HeldBlocksRequest(keys=[SCOPE.key(b"\0" * 32)])
    for token, words in ((None, "needs the fleet's token"), (b"not-the-token-at-all", "is not this fleet's")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call(loop_thread, b.stub.HeldBlocks, request, token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and words in err.value.details()
    assert list(call(loop_thread, b.stub.HeldBlocks, request).held) == [False]


def test_f20_a_fleet_with_tenant_auth_needs_a_token_file(tmp_path: Path) -> None:
    from gateway.fleet_servicer import load_token

    with pytest.raises(ConfigError, match="token_file is unset"):
        load_token(FleetSettings(), auth_enabled=True)
    assert load_token(FleetSettings(), auth_enabled=False) is None
    (tmp_path / "t").write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_token(FleetSettings(token_file=str(tmp_path / "t")), auth_enabled=False)


def test_f17_a_copy_request_parsed_as_views_is_what_protobuf_parses() -> None:
    """The node reads a CopyBlocks request from its wire bytes (`parse_copies`: each block's data a view, not a
    copy): field for field what protobuf parses, absent fields their defaults, unknown fields skipped; bytes
    that are not the message are INVALID_ARGUMENT."""
    from gateway.fleet_servicer import parse_copies, parse_request
    from kvstore.errors import InvalidArgument

    blocks = [pb.CopiedBlock(key=os.urandom(48), namespace="tenant-é", parent_hash=os.urandom(32), depth=9,
                             data=os.urandom(3000), checksum=(1 << 64) - 5, last_use_s=1.75e9 + 0.25),
              pb.CopiedBlock(key=os.urandom(48), data=b"\x00" * 70_000),  # defaults elsewhere
              pb.CopiedBlock()]
    raw = pb.CopyBlocksRequest(blocks=blocks).SerializeToString()
    raw += b"\x48\x07" + b"\x52\x03abc"  # unknown fields 9 (varint) and 10 (bytes) of the request: skipped
    got = parse_copies(raw)
    assert [(c.key, c.namespace, c.parent_hash, c.depth, bytes(c.data), c.checksum, c.last_use_s) for c in got] == [
        (b.key, b.namespace, b.parent_hash, b.depth, b.data, b.checksum, b.last_use_s) for b in blocks]
    # A bulk copy's: no data, the block's address in the source's map, the source's engine named.
    bulk = pb.CopyBlocksRequest(blocks=[pb.CopiedBlock(key=os.urandom(48), depth=3, source_address=(1 << 64) - 9)],
                                bulk_segment="127.0.0.1:15001")
    copies, segment = parse_request(bulk.SerializeToString())
    assert segment == "127.0.0.1:15001"
    assert [(c.source_address, bytes(c.data)) for c in copies] == [((1 << 64) - 9, b"")]
    assert got[0].data.obj is raw  # a view of the request, not a copy
    for bad in (raw[:-40], b"\x0a\x05\x0a\x09abc", b"\x0b", b"\x0a\x02\x08"):
        with pytest.raises(InvalidArgument, match="does not parse"):
            parse_copies(bad)


def test_f18_planning_calls_are_answered_while_the_stores_threads_are_busy(nodes: Any,
                                                                          loop_thread: LoopThread) -> None:
    """F18: RunDigests and HeldBlocks are read on the servicer's planning threads, so a repairer's planning
    round is not queued behind the copies' checks and commits that hold the store's executor."""
    a = nodes("a")
    hashes, blocks = chain(6)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    threads = a.tier.settings.io_threads
    started, release = threading.Semaphore(0), threading.Event()

    def hold() -> None:
        started.release()
        release.wait(30)  # released below; the bound only keeps a failing test from hanging

    held = [a.tier.executor.submit(hold) for _ in range(threads)]
    try:
        for _ in range(threads):  # every thread of the store's executor is held now
            assert started.acquire(timeout=10)
        metadata = ((TOKEN_METADATA, TOKEN.decode()),)

        async def plan() -> tuple[Any, Any]:
            digests = await a.stub.RunDigests(pb.RunDigestsRequest(run_roots=[keys[0], keys[4]]),
                                              metadata=metadata, timeout=10)
            held_blocks = await a.stub.HeldBlocks(pb.HeldBlocksRequest(keys=keys), metadata=metadata, timeout=10)
            return digests, held_blocks

        digests, held_blocks = loop_thread.run(plan())
        assert [d.blocks for d in digests.runs] == [4, 2]
        assert list(held_blocks.held) == [True] * 6
    finally:
        release.set()
        for f in held:
            f.result(timeout=10)
