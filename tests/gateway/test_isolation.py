"""Isolation between tenants, on a real server with tokens (docs/SECURITY.md "Isolation").

Tenant B knows everything of tenant A's but its token: the hashes of A's blocks,
the keys of A's snapshots, A's transfer session and region ids. Whatever B does
with them answers exactly as for things that never existed, and leaves A's data as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvstore import api_tokens
from kvstore.client import Client
from kvstore.config import StoreSettings
from kvstore.errors import PermissionDenied
from kvstore.transfer import Descriptor, Op, group
from kvstore.v1 import kvstore_pb2 as kvpb
from kvstore.v1 import kvstore_pb2_grpc as kv_grpc
from kvstore.v1 import swa_pb2 as swapb
from kvstore.v1 import swa_pb2_grpc as swa_grpc
from kvstore.v1 import transfer_pb2 as trpb
from kvstore.v1 import transfer_pb2_grpc as tr_grpc

TOKENS = list(range(64))  # 4 blocks of 16
RW = frozenset({"read", "write"})


class Tenants:
    """A server with tenants A and B, a client of each, and A's blocks and snapshot stored."""

    def __init__(self, server: Any, a: Client, b: Client, b_token: str) -> None:
        self.server, self.a, self.b = server, a, b
        self.b_metadata = (("authorization", f"Bearer {b_token}"),)
        self.blocks = [os.urandom(a.block_bytes) for _ in range(4)]
        self.hashes = a.put(TOKENS, self.blocks).block_hashes
        self.snapshot = os.urandom(a.swa.snapshot_bytes(len(TOKENS)))
        assert a.swa.put(TOKENS, self.snapshot).stored == 1
        self.swa_key = a.swa.key(TOKENS)

    def unknown(self, n: int) -> list[bytes]:
        return [os.urandom(32) for _ in range(n)]

    def a_is_intact(self) -> bool:
        return self.a.get(TOKENS).blocks == self.blocks and self.a.swa.get(TOKENS) == self.snapshot


@pytest.fixture
def tenants(start_server: Callable[..., Any], store_settings: StoreSettings) -> Iterator[Tenants]:
    path = store_settings.data_dir / "tenants.json"
    a_token = api_tokens.create(path, "tenant-a", RW)[1]
    b_token = api_tokens.create(path, "tenant-b", RW)[1]
    server = start_server(store_settings)
    with Client(server.target, token=a_token) as a, Client(server.target, token=b_token) as b:
        yield Tenants(server, a, b, b_token)


def test_lookup_of_anothers_hashes_misses_like_unknown_hashes(tenants: Tenants) -> None:
    stub = kv_grpc.KVStoreStub(tenants.b.connection.channel)

    def lookup(hashes: list[bytes]) -> kvpb.LookupResponse:
        return stub.Lookup(kvpb.LookupRequest(block_hashes=hashes, lease_ms=1000, swa_keys=[tenants.swa_key],
                                              swa_positions=[len(TOKENS)]), metadata=tenants.b_metadata, timeout=10)

    theirs, unknown = lookup(tenants.hashes), lookup(tenants.unknown(4))
    assert theirs == unknown == kvpb.LookupResponse()  # every field at its default: nothing found, no lease
    assert tenants.b.lookup(TOKENS, swa_positions=[len(TOKENS)]).found_blocks == 0
    assert tenants.a.lookup(TOKENS).found_blocks == 4


def test_get_of_anothers_hashes_is_not_found_like_unknown_hashes(tenants: Tenants) -> None:
    stub = kv_grpc.KVStoreStub(tenants.b.connection.channel)

    def get(hashes: list[bytes]) -> list[kvpb.GetResponse]:
        return list(stub.Get(kvpb.GetRequest(block_hashes=hashes), metadata=tenants.b_metadata, timeout=10))

    theirs, unknown = get(tenants.hashes), get(tenants.unknown(4))
    assert theirs == unknown and {r.status for r in theirs} == {kvpb.BLOCK_STATUS_MISSING}
    assert tenants.b.get(TOKENS).blocks == [None] * 4


def test_put_into_anothers_namespace_is_refused_and_own_put_does_not_touch_theirs(tenants: Tenants) -> None:
    with Client(tenants.server.target, token=tenants.b_metadata[0][1][7:], namespace="tenant-a") as spoof, \
            pytest.raises(PermissionDenied, match="not this token's tenant"):
        spoof.put(TOKENS, [bytes(spoof.block_bytes)] * 4)
    tenants.b.put(TOKENS, [bytes(tenants.b.block_bytes)] * 4)  # the same hashes, B's own namespace
    assert tenants.a_is_intact() and tenants.b.get(TOKENS).blocks == [bytes(tenants.b.block_bytes)] * 4


def test_swa_get_put_delete_are_confined(tenants: Tenants) -> None:
    b = tenants.b
    assert b.swa.get(TOKENS) is None and b.swa.get_many([tenants.swa_key, os.urandom(32)]) == [None, None]
    assert b.swa.delete_many([tenants.swa_key]) == 0
    stub = swa_grpc.SwaPoolStub(b.connection.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Delete(swapb.SwaDeleteRequest(namespace="tenant-a", keys=[tenants.swa_key]),
                    metadata=tenants.b_metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert b.swa.put(TOKENS, os.urandom(b.swa.snapshot_bytes(len(TOKENS)))).stored == 1  # B's own copy
    assert tenants.a_is_intact()


def _submit(channel: grpc.Channel, metadata: Any, session_id: str) -> tuple[grpc.StatusCode, str]:
    request = trpb.SubmitRequest(session_id=session_id, op=trpb.TRANSFER_OP_READ,
                                 groups=[trpb.DescriptorGroup(region_id=1, length_bytes=1, offsets_bytes=[0])])
    try:
        tr_grpc.TransferStub(channel).Submit(request, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_anothers_transfer_session_is_unknown_even_on_its_connection(tenants: Tenants) -> None:
    with tenants.a.transfer() as session:
        # On A's own connection (same peer) and on B's: as an id that never was.
        for channel in (tenants.a.connection.channel, tenants.b.connection.channel):
            theirs = _submit(channel, tenants.b_metadata, session.session_id)
            never = _submit(channel, tenants.b_metadata, "0" * 32)
            assert theirs == never and theirs[0] == grpc.StatusCode.NOT_FOUND


def test_anothers_region_is_unknown(tenants: Tenants) -> None:
    a, b = tenants.a, tenants.b
    with a.transfer() as sa, b.transfer() as sb:
        theirs = sa.register(a.block_bytes)
        size = b.block_bytes
        state = sb._paths["shm"].read(group([
            Descriptor(block_hash=tenants.hashes[0], region_id=theirs.region_id, offset_bytes=0, length_bytes=size),
            Descriptor(block_hash=tenants.hashes[0], region_id=987654, offset_bytes=0, length_bytes=size),
        ], Op.READ), False).wait()
        assert [r.code for r in state.results] == ["NOT_FOUND", "NOT_FOUND"]
        assert state.results[0].reason.replace(str(theirs.region_id), "N") == \
            state.results[1].reason.replace("987654", "N")


def test_anothers_lease_cannot_be_released(tenants: Tenants) -> None:
    lease = tenants.a.lookup(TOKENS, lease_ms=60_000).lease_id
    assert lease is not None
    assert not tenants.b.release(lease)  # as for an unknown lease
    assert tenants.a.release(lease)  # still A's to release
