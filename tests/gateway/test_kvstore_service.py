"""The KVStore service end to end: a real gRPC server on loopback over a real LMDB."""

from __future__ import annotations

import os
import re
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import Client
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.prefix import MAX_EXTRA_KEY_BYTES, MAX_EXTRA_KEYS, MAX_EXTRA_KEYS_BYTES, root_hash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def blocks_for(client: Client, n: int) -> list[bytes]:
    return [os.urandom(client.block_bytes) for _ in range(n)]


def raw_stub(server: Any) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(server.target, options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]))


def status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return info.value.code(), info.value.details()


def test_put_lookup_get_round_trip(client: Client) -> None:
    tokens = list(range(client.block_tokens * 5 + 3))  # 5 full blocks and a partial one
    blocks = blocks_for(client, 5)
    assert client.lookup(tokens).found_tokens == 0
    put = client.put(tokens, blocks)
    assert put.written_blocks == 5 and put.block_hashes == client.hashes(tokens)
    assert client.lookup(tokens).found_tokens == 5 * client.block_tokens
    got = client.get(tokens)
    assert got.blocks == blocks and got.statuses == ["found"] * 5


def test_put_in_parts_extends_the_chain(client: Client) -> None:
    tokens = list(range(client.block_tokens * 6))
    blocks = blocks_for(client, 6)
    client.put(tokens[: client.block_tokens * 2], blocks[:2])
    client.put(tokens, blocks[2:], first_block=2)
    assert client.lookup(tokens).found_blocks == 6
    assert client.get(tokens).blocks == blocks


def test_get_reports_missing_blocks_per_block(client: Client) -> None:
    tokens = list(range(client.block_tokens * 4))
    blocks = blocks_for(client, 2)
    client.put(tokens[: client.block_tokens * 2], blocks)
    got = client.get(tokens)
    assert got.statuses == ["found", "found", "missing", "missing"]
    assert got.found_prefix_blocks == 2
    assert got.blocks[:2] == blocks


def test_torch_tensors_in_and_out(client: Client) -> None:
    tokens = list(range(client.block_tokens * 3))
    tensor = torch.randint(0, 256, (3, client.block_bytes), dtype=torch.uint8)
    client.put(tokens, tensor)
    out, filled = client.get_tensor(tokens)
    assert filled == 3 and torch.equal(out, tensor)


def test_extra_keys_and_tenants_separate_blocks(server: Any, client: Client) -> None:
    tokens = list(range(client.block_tokens * 2))
    client.put(tokens, blocks_for(client, 2), extra_keys=["adapter:a"])
    assert client.lookup(tokens).found_blocks == 0
    assert client.lookup(tokens, extra_keys=["adapter:a"]).found_blocks == 2
    with Client(server.target, namespace="tenant-b") as other:
        assert other.lookup(tokens, extra_keys=["adapter:a"]).found_blocks == 0
        assert other.get(tokens, extra_keys=["adapter:a"]).statuses == ["missing"] * 2


def test_lookup_lease_and_release(client: Client) -> None:
    tokens = list(range(client.block_tokens * 2))
    client.put(tokens, blocks_for(client, 2))
    result = client.lookup(tokens, lease_ms=5000)
    assert result.lease_id
    assert client.stats().active_leases == 1
    assert client.release(result.lease_id) is True
    assert client.release(result.lease_id) is False
    assert client.stats().active_leases == 0


def test_lease_expires_with_the_clock(client: Client, clock: Any) -> None:
    tokens = list(range(client.block_tokens * 2))
    client.put(tokens, blocks_for(client, 2))
    client.lookup(tokens, lease_ms=2000)
    assert client.stats().active_leases == 1
    clock.advance(2.5)
    assert client.stats().active_leases == 0


def test_stats_keep_lookup_and_retrieve_hit_rates_apart(client: Client) -> None:
    tokens = list(range(client.block_tokens * 4))
    client.put(tokens[: client.block_tokens * 2], blocks_for(client, 2))
    client.lookup(tokens)           # 2 of 4 blocks found
    client.get(tokens[: client.block_tokens * 2])  # 2 of 2 returned
    s = client.stats()
    bt = client.block_tokens
    assert (s.lookup_tokens_asked, s.lookup_tokens_found) == (4 * bt, 2 * bt)
    assert (s.get_tokens_asked, s.get_tokens_returned) == (2 * bt, 2 * bt)
    assert s.blocks_stored == 2 and s.bytes_stored == 2 * client.block_bytes
    assert s.puts == 1 and s.blocks_written == 2


# -- bad input: a clear status, nothing stored ---------------------------------

def assert_nothing_stored(client: Client) -> None:
    assert client.stats().blocks_stored == 0


def test_block_of_wrong_size_is_invalid(client: Client) -> None:
    tokens = list(range(client.block_tokens))
    with pytest.raises(InvalidArgument, match=rf"(block 0|blocks\[0\]) is 10 bytes.*{client.block_bytes}"):
        client.put(tokens, [b"x" * 10])
    assert_nothing_stored(client)


def test_unknown_geometry_is_invalid(server: Any, client: Client) -> None:
    stub = raw_stub(server)
    code, details = status_of(lambda: stub.Lookup(pb.LookupRequest(geometry="llama-7b", block_hashes=[b"h" * 32])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown geometry 'llama-7b'" in details
    with pytest.raises(InvalidArgument, match="does not serve geometry"):
        Client(server.target, geometry="llama-7b")


def test_malformed_hash_is_invalid(server: Any) -> None:
    stub = raw_stub(server)
    code, details = status_of(lambda: stub.Get(pb.GetRequest(block_hashes=[b"short"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes[0] is 5 bytes" in details
    code, details = status_of(lambda: stub.Put(pb.PutRequest(parent_hash=b"abc", token_ids=[1] * 16,
                                                             blocks=[b"x"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_empty_and_oversized_batches_are_invalid(server: Any, client: Client) -> None:
    stub = raw_stub(server)
    code, details = status_of(lambda: stub.Lookup(pb.LookupRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in details
    code, details = status_of(lambda: stub.Put(pb.PutRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in details
    limit = client.max_batch_blocks
    code, details = status_of(lambda: stub.Get(pb.GetRequest(block_hashes=[b"h" * 32] * (limit + 1))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"at most {limit}" in details
    assert_nothing_stored(client)


def test_block_count_must_match_full_blocks(server: Any, client: Client) -> None:
    stub = raw_stub(server)
    bt = client.block_tokens
    request = pb.PutRequest(token_ids=list(range(bt * 3 + 1)), blocks=blocks_for(client, 2))
    code, details = status_of(lambda: stub.Put(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{bt * 3 + 1} token ids make 3 full blocks" in details and "2 blocks were sent" in details
    assert_nothing_stored(client)


def test_missing_parent_is_failed_precondition(client: Client) -> None:
    tokens = list(range(client.block_tokens * 3))
    with pytest.raises(FailedPrecondition, match="put the prefix first"):
        client.put(tokens, blocks_for(client, 1), first_block=2)
    assert_nothing_stored(client)


def test_bad_namespace_is_invalid(server: Any) -> None:
    with Client(server.target, namespace="no spaces/allowed") as bad, \
            pytest.raises(InvalidArgument, match="namespace"):
        bad.lookup(list(range(64)))


@pytest.mark.parametrize("name", ["tenant-a\n", "tenant-a\r\n", "default\n"])
def test_namespace_must_match_in_full(server: Any, client: Client, name: str) -> None:
    # A trailing newline passed a `^...$` pattern: it was another tenant with the same name.
    stub = raw_stub(server)
    tokens = list(range(client.block_tokens))
    request = pb.PutRequest(namespace=name, token_ids=tokens, blocks=blocks_for(client, 1))
    code, details = status_of(lambda: stub.Put(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in details
    assert_nothing_stored(client)


# -- extra keys: bounded (a huge key froze the server) ---------------------------

def put_with_extra_keys(client: Client, extra_keys: list[bytes]) -> pb.PutRequest:
    tokens = list(range(client.block_tokens * 2))
    return pb.PutRequest(token_ids=tokens, extra_keys=extra_keys, blocks=blocks_for(client, 2))


@pytest.mark.parametrize(("extra_keys", "message"), [
    ([b"k"] * (MAX_EXTRA_KEYS + 1), f"extra_keys has {MAX_EXTRA_KEYS + 1} keys; at most {MAX_EXTRA_KEYS}"),
    ([b"a", b"x" * (MAX_EXTRA_KEY_BYTES + 1)],
     f"extra_keys\\[1\\] is {MAX_EXTRA_KEY_BYTES + 1} bytes; an extra key is at most {MAX_EXTRA_KEY_BYTES}"),
    ([b"x" * MAX_EXTRA_KEY_BYTES] * (MAX_EXTRA_KEYS_BYTES // MAX_EXTRA_KEY_BYTES) + [b"y"],
     f"more than {MAX_EXTRA_KEYS_BYTES} bytes in all \\({MAX_EXTRA_KEYS_BYTES + 1} by key"),
])
def test_extra_keys_are_bounded(server: Any, client: Client, extra_keys: list[bytes], message: str) -> None:
    stub = raw_stub(server)
    code, details = status_of(lambda: stub.Put(put_with_extra_keys(client, extra_keys)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, details), details
    assert_nothing_stored(client)


def test_a_huge_extra_key_is_refused_at_once(server: Any, client: Client) -> None:
    # One 60 MB key used to be hashed once per block on the event loop (89 s for every caller).
    stub = raw_stub(server)
    code, details = status_of(lambda: stub.Put(put_with_extra_keys(client, [b"x" * (8 << 20)])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"is {8 << 20} bytes" in details
    assert_nothing_stored(client)


def test_extra_keys_at_their_limits_are_stored_and_found(client: Client) -> None:
    per_key = MAX_EXTRA_KEYS_BYTES // MAX_EXTRA_KEYS
    keys = [bytes([i]) * per_key for i in range(MAX_EXTRA_KEYS)]
    tokens = list(range(client.block_tokens * 2))
    assert client.put(tokens, blocks_for(client, 2), extra_keys=keys).written_blocks == 2
    assert client.lookup(tokens, extra_keys=keys).found_blocks == 2
    big = [b"x" * MAX_EXTRA_KEY_BYTES]
    assert client.put(tokens, blocks_for(client, 2), extra_keys=big).written_blocks == 2


def test_server_speaks_health_and_reflection(server: Any) -> None:
    channel = grpc.insecure_channel(server.target)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore")).status == \
        health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names


def test_info_describes_the_layout(client: Client) -> None:
    from kvstore.geometry import V4_1_FLASH

    assert client.block_bytes == V4_1_FLASH.block_bytes(client.block_tokens)
    assert client.fingerprint == V4_1_FLASH.fingerprint
    assert client.root == root_hash(V4_1_FLASH.fingerprint, client.block_tokens)


def test_long_put_streams_batches(client: Client) -> None:
    bt = client.block_tokens
    tokens = list(range(bt * 9))
    blocks = blocks_for(client, 9)
    seen: list[int] = []
    result = client.put(tokens, blocks, batch_blocks=2, on_batch=seen.append)
    assert seen == [2, 2, 2, 2, 1] and result.written_blocks == 9
    assert result.block_hashes == client.hashes(tokens)
    assert client.get(tokens).blocks == blocks
    assert client.stats().puts == 5


def put_stream_batches(client: Client, tokens: list[int], blocks: list[bytes], per: int) -> list[pb.PutRequest]:
    """The PutStream requests of a chain, `per` blocks each, as the client would chain them."""
    bt, hashes = client.block_tokens, client.hashes(tokens)
    return [pb.PutRequest(parent_hash=hashes[i - 1] if i else b"", token_ids=tokens[i * bt:(i + per) * bt],
                          blocks=blocks[i:i + per]) for i in range(0, len(blocks), per)]


def test_put_stream_stops_at_first_bad_batch_keeping_earlier_ones(server: Any, client: Client) -> None:
    # Sent raw: the client checks block sizes itself before sending anything.
    tokens = list(range(client.block_tokens * 6))
    blocks = blocks_for(client, 6)
    blocks[4] = b"short"
    replies: list[pb.PutResponse] = []
    code, details = status_of(lambda: replies.extend(
        raw_stub(server).PutStream(iter(put_stream_batches(client, tokens, blocks, 2)))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block 0 is 5 bytes" in details
    assert [r.written_blocks for r in replies] == [2, 2]  # batches 1 and 2 were committed and acknowledged
    assert client.lookup(tokens).found_blocks == 4
    assert client.stats().blocks_stored == 4
