"""Bytes that are not a request message, sent to every method of every service of a
real server on loopback: INVALID_ARGUMENT and one log line each, never UNKNOWN
with a traceback; a request stream ends at the bad message."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from gateway.undecodable import UndecodableRequests
from kvstore.client import Client
from kvstore.v1 import kvstore_pb2, swa_pb2, transfer_pb2

#: Not a protobuf message of any type: a field tag whose varint never ends.
GARBAGE = b"\xff\xff\xff"
#: The services a client can call, by their descriptors.
SERVICES = [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"], swa_pb2.DESCRIPTOR.services_by_name["SwaPool"],
            transfer_pb2.DESCRIPTOR.services_by_name["Transfer"], health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
METHODS = [m for s in SERVICES for m in s.methods]


def path_of(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def call_raw(channel: grpc.Channel, method: MethodDescriptor, requests: list[bytes]) -> grpc.RpcError | None:
    """Send raw request bytes to `method`; the error it ended with (None: it ended OK)."""
    path, timeout = path_of(method), 20
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path)(iter(requests), timeout=timeout))
        elif method.client_streaming:
            channel.stream_unary(path)(iter(requests), timeout=timeout)
        elif method.server_streaming:
            list(channel.unary_stream(path)(requests[0], timeout=timeout))
        else:
            channel.unary_unary(path)(requests[0], timeout=timeout)
    except grpc.RpcError as exc:
        return exc
    return None


@pytest.fixture
def channel(server: Any) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def refusals(caplog: pytest.LogCaptureFixture, path: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if path in r.getMessage()]


@pytest.mark.parametrize("method", METHODS, ids=path_of)
def test_undecodable_request_is_invalid_argument_with_one_log_line(
        channel: grpc.Channel, method: MethodDescriptor, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    error = call_raw(channel, method, [GARBAGE])
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "could not be decoded" in error.details() and method.input_type.full_name in error.details()
    logged = refusals(caplog, path_of(method))
    assert len(logged) == 1 and logged[0].exc_info is None, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info or "Unexpected" in r.getMessage()]


def test_put_stream_ends_at_an_undecodable_message_keeping_earlier_batches(
        server: Any, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    tokens = list(range(client.block_tokens * 2))
    blocks = [os.urandom(client.block_bytes) for _ in range(2)]
    good = kvstore_pb2.PutRequest(token_ids=tokens, blocks=blocks).SerializeToString()
    answered = threading.Event()

    def requests() -> Iterator[bytes]:
        yield good
        yield GARBAGE
        answered.wait(30)  # the client keeps its side open: the server must end the call

    replies: list[kvstore_pb2.PutResponse] = []
    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_stream("/kvstore.v1.KVStore/PutStream",
                                     response_deserializer=kvstore_pb2.PutResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            for reply in call(requests(), timeout=20):
                replies.append(reply)
        answered.set()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "could not be decoded" in info.value.details()
    assert [r.written_blocks for r in replies] == [2]
    assert client.get(tokens).blocks == blocks
    assert len(refusals(caplog, "/kvstore.v1.KVStore/PutStream")) == 1


def test_server_serves_after_undecodable_requests(server: Any, channel: grpc.Channel, client: Client) -> None:
    for method in METHODS:
        call_raw(channel, method, [GARBAGE])
    tokens = list(range(client.block_tokens))
    block = os.urandom(client.block_bytes)
    client.put(tokens, [block])
    assert client.get(tokens).blocks == [block]


def test_a_request_stream_read_by_a_coroutine_ends_invalid_argument(loop_thread: Any) -> None:
    # No service here reads a stream into one answer; the guard covers that shape too.
    async def count(requests: Any, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        async for _ in requests:
            pass
        return health_pb2.HealthCheckResponse()

    handler = grpc.method_handlers_generic_handler("test.Counter", {"Count": grpc.stream_unary_rpc_method_handler(
        count, request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString)})

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=[UndecodableRequests()])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            count_call = channel.stream_unary("/test.Counter/Count")
            assert count_call(iter([b"", b""]), timeout=20) == b""
            with pytest.raises(grpc.RpcError) as info:
                count_call(iter([b"", GARBAGE]), timeout=20)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not be decoded" in info.value.details()
    finally:
        loop_thread.run(server.stop(0))
