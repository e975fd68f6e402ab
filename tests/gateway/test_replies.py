"""Replies the servicer serializes itself (gateway/replies.py): byte for byte what protobuf writes,
on their own and from a real server's Get stream."""

from __future__ import annotations

import os
from typing import Any

import grpc
import pytest

from gateway.replies import add_service, found_reply, passthrough
from kvstore.client import Client
from kvstore.protowire import length_delimited
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


@pytest.mark.parametrize("index", [0, 1, 127, 128, 16_383, 16_384, 2**32 - 1])
@pytest.mark.parametrize("size", [1, 127, 128, 56_960])
def test_a_found_reply_is_what_protobuf_writes(index: int, size: int) -> None:
    data = os.urandom(size)
    assert found_reply(index, memoryview(data)) == pb.GetResponse(
        index=index, status=pb.BLOCK_STATUS_FOUND, data=data).SerializeToString()


def test_length_delimited_and_passthrough() -> None:
    for n in (1, 127, 128, 300, 16_384, (1 << 21) + 5):
        head = length_delimited(3, n)
        assert pb.GetResponse(data=b"x" * n).SerializeToString() == head + b"x" * n
    message = pb.GetResponse(index=3, status=pb.BLOCK_STATUS_MISSING)
    assert passthrough(message) == message.SerializeToString()
    assert passthrough(b"made already") == b"made already"


def test_a_method_the_service_lacks_is_refused() -> None:
    class Server:
        def add_generic_rpc_handlers(self, _handlers: object) -> None:
            raise AssertionError("nothing is registered")

        def add_registered_method_handlers(self, _service: str, _handlers: object) -> None:
            raise AssertionError("nothing is registered")

    with pytest.raises(ValueError, match="Gett"):
        add_service(pb_grpc.add_KVStoreServicer_to_server, pb_grpc.KVStoreServicer(), Server(),  # type: ignore[arg-type]
                    presized={"Gett"})


def test_a_get_stream_is_what_protobuf_writes(client: Client, server: Any) -> None:
    tokens = list(range(3 * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(3)]
    client.put(tokens, blocks)
    hashes = client.hashes(tokens)
    asked = [hashes[0], b"\x09" * 32, hashes[2], hashes[1]]
    with grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        raw = channel.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString)
        wires = list(raw(pb.GetRequest(block_hashes=asked)))
    expected = [pb.GetResponse(index=0, status=pb.BLOCK_STATUS_FOUND, data=blocks[0]),
                pb.GetResponse(index=1, status=pb.BLOCK_STATUS_MISSING),
                pb.GetResponse(index=2, status=pb.BLOCK_STATUS_FOUND, data=blocks[2]),
                pb.GetResponse(index=3, status=pb.BLOCK_STATUS_FOUND, data=blocks[1])]
    assert wires == [m.SerializeToString() for m in expected]
    assert client.get_hashes(asked).blocks == [blocks[0], None, blocks[2], blocks[1]]
