"""A Lookup's hashes as one packed field (LookupRequest.block_hashes_packed): the same answer as the
repeated field, refused with a clear status when malformed; the client sends it where the server reads it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import grpc
import pytest

from kvstore.client import Client
from kvstore.config import StoreSettings
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def stub_of(server: Any) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(server.target))


def status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_packed_hashes_find_what_the_repeated_field_finds(server: Any, client: Client) -> None:
    tokens = list(range(client.block_tokens * 600))
    client.put(tokens[:client.block_tokens * 300], [os.urandom(client.block_bytes) for _ in range(300)])
    hashes = client.hashes(tokens)
    stub = stub_of(server)
    for prefix in (hashes[:1], hashes[:299], hashes[:300], hashes[:301], hashes, hashes[1:]):
        packed = stub.Lookup(pb.LookupRequest(block_hashes_packed=b"".join(prefix)))
        plain = stub.Lookup(pb.LookupRequest(block_hashes=prefix))
        assert packed.found_blocks == plain.found_blocks == min(len(prefix), 300) * (prefix[0] == hashes[0])


def test_the_client_sends_packed_hashes_where_the_server_reads_them(client: Client) -> None:
    tokens = list(range(client.block_tokens * 3))
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(3)])
    assert client.connection.lookup_packed_hashes  # GetInfo said so
    assert client.lookup(tokens).found_blocks == 3
    client.connection.lookup_packed_hashes = False  # as an older server would answer GetInfo
    assert client.lookup(tokens).found_blocks == 3
    assert client.lookup_hashes(client.hashes(tokens)[:2]).found_blocks == 2


def test_malformed_packed_hashes_are_invalid(server: Any) -> None:
    stub = stub_of(server)
    code, details = status_of(lambda: stub.Lookup(pb.LookupRequest(block_hashes_packed=b"h" * 33)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes_packed is 33 bytes" in details
    code, details = status_of(lambda: stub.Lookup(pb.LookupRequest(block_hashes_packed=b"h" * 32,
                                                                    block_hashes=[b"h" * 32])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not both" in details


def test_more_packed_hashes_than_the_limit_are_invalid(start_server: Any, store_settings: StoreSettings) -> None:
    srv = start_server(dataclasses.replace(store_settings, max_lookup_blocks=8))
    code, details = status_of(lambda: stub_of(srv).Lookup(pb.LookupRequest(block_hashes_packed=b"h" * 32 * 9)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "has 9 hashes; at most 8" in details
