"""The block store seam's contract (tiers/store.py), run against every implementation.

The KVStore servicer sees a store only through `tiers.store.BlockStore`: each test
serves one store with the real servicer on a real gRPC server on loopback and
talks to it with `kvstore.Client`, so a servicer that reached past the Protocol
(into LMDB, or the tier's leases) fails on the in-memory store. Implementations:
the LMDB tier (a real LMDB in a temp dir) and `MemoryStore`, a fake kept honest by
this same suite (CONVENTIONS habit 11).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gateway.kvstore_servicer import KVStoreServicer
from gateway.replies import add_service
from gateway.validate import Layout
from kvstore import geometry
from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import FailedPrecondition
from kvstore.v1 import kvstore_pb2_grpc
from tests.conftest import LoopThread
from tests.tiers.memory_store import MemoryStore
from tiers.lmdb_tier import LmdbBlockTier
from tiers.store import BlockStore, ManagedStore, MappedReads, MappedStore


async def _serve(store: BlockStore) -> tuple[grpc.aio.Server, int]:
    """The KVStore servicer over `store`, alone on a loopback port (no interceptors: the open caller)."""
    layouts = {g.name: Layout.of(g, store.settings.block_tokens) for g in geometry.REGISTRY.values()}
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_service(kvstore_pb2_grpc.add_KVStoreServicer_to_server, KVStoreServicer(store, layouts, 64 << 20), server,
                presized={"Get"})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture(params=["lmdb", "memory"])
def store(request: pytest.FixtureRequest, store_settings: StoreSettings, clock: ManualClock) -> Iterator[Any]:
    """Each implementation of the seam, on the test store's settings."""
    made = LmdbBlockTier(store_settings, clock=clock) if request.param == "lmdb" else MemoryStore(store_settings, clock)
    yield made
    made.close()


@pytest.fixture
def client(store: BlockStore, loop_thread: LoopThread) -> Iterator[Client]:
    """A client of the servicer over `store`."""
    server, port = loop_thread.run(_serve(store))
    with Client(f"127.0.0.1:{port}") as c:
        yield c
    loop_thread.run(server.stop(0))


def _blocks(client: Client, n: int) -> list[bytes]:
    return [os.urandom(client.block_bytes) for _ in range(n)]


def test_each_store_meets_the_protocol_and_says_its_capabilities(store: Any) -> None:
    assert isinstance(store, BlockStore)
    mapped = isinstance(store, LmdbBlockTier)  # only a store on this host's LMDB reads out of the map
    assert isinstance(store, MappedReads) is mapped and isinstance(store, MappedStore) is mapped
    assert isinstance(store, ManagedStore) is mapped


def test_put_lookup_get_through_the_servicer(client: Client) -> None:
    tokens = list(range(client.block_tokens * 4 + 1))
    blocks = _blocks(client, 4)
    assert client.lookup(tokens).found_blocks == 0
    put = client.put(tokens, blocks)
    assert (put.written_blocks, put.existing_blocks) == (4, 0) and put.block_hashes == client.hashes(tokens)
    assert client.put(tokens, blocks).existing_blocks == 4  # the same blocks again: stored once
    assert client.lookup(tokens).found_tokens == 4 * client.block_tokens
    got = client.get(tokens)
    assert got.blocks == blocks and got.statuses == ["found"] * 4
    assert client.stats().blocks_stored == 4


def test_a_lookup_counts_only_the_stored_chain(client: Client) -> None:
    tokens = list(range(client.block_tokens * 5))
    client.put(tokens[:client.block_tokens * 3], _blocks(client, 3))
    hashes = client.hashes(tokens)
    assert client.lookup(tokens).found_blocks == 3
    # R15: a stored block after an absent one, or out of its place, is not found.
    assert client.lookup_hashes([hashes[0], hashes[3], hashes[2]]).found_blocks == 1
    assert client.lookup_hashes([hashes[1], hashes[2]]).found_blocks == 0
    assert client.get(tokens).statuses == ["found"] * 3 + ["missing"] * 2


def test_a_put_on_a_missing_parent_is_refused(client: Client) -> None:
    tokens = list(range(client.block_tokens * 4))
    with pytest.raises(FailedPrecondition):
        client.put(tokens, _blocks(client, 2), first_block=2)
    assert client.get(tokens).statuses == ["missing"] * 4


def test_a_lease_is_released_once(client: Client) -> None:
    tokens = list(range(client.block_tokens * 2))
    client.put(tokens, _blocks(client, 2))
    found = client.lookup(tokens, lease_ms=60_000)
    assert found.found_blocks == 2 and found.lease_id
    assert client.release(found.lease_id) is True
    assert client.release(found.lease_id) is False
