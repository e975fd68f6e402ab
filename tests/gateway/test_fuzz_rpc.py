"""Every RPC of a real server on loopback, fuzzed: hypothesis-built messages of each
method's request type (fields filled at random, some near-valid) and random bytes.

The server must answer each call with a clear status (never UNKNOWN, INTERNAL,
UNAVAILABLE, nor hang until the deadline), stay up, and still round-trip a good
Put and Get afterwards. Bounded for CI: a few dozen examples per method.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.validate import Layout
from kvstore import geometry
from kvstore.client import Client
from kvstore.prefix import HASH_BYTES
from kvstore.swa_snapshot import checksum, snapshot_bytes
from kvstore.v1 import kvstore_pb2, swa_pb2, transfer_pb2

SERVICES = [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"], swa_pb2.DESCRIPTOR.services_by_name["SwaPool"],
            transfer_pb2.DESCRIPTOR.services_by_name["Transfer"], health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
METHODS = [m for s in SERVICES for m in s.methods]
#: Statuses that say the server failed, not the request: a bug, a crash, or a hang.
NOT_CLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
             grpc.StatusCode.DEADLINE_EXCEEDED}
CALL_TIMEOUT_S = 20
EXAMPLES = 100

BLOCK_TOKENS = 16  # conftest's store_settings
LAYOUT = Layout.of(geometry.V4_1_FLASH, BLOCK_TOKENS)

# -- messages from descriptors -------------------------------------------------

_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_HASH = st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES)
_HASHES = st.one_of(_HASH, _HASH, st.binary(max_size=HASH_BYTES + 8))
#: Values that reach past the first checks: one element of a field, by field name.
_ELEMENT_HINTS: dict[str, st.SearchStrategy[Any]] = {
    "geometry": st.sampled_from(["", "", geometry.V4_1_FLASH.name, *geometry.REGISTRY, "llama-7b", "x\n"]),
    "namespace": st.one_of(st.sampled_from(["", "default", "tenant-a"]), st.text(max_size=130),
                           st.sampled_from(["tenant-a\n", "no spaces", "-x", "a" * 129, "é"])),
    "service": st.sampled_from(["", "kvstore.v1.KVStore", "kvstore.v1.SwaPool", "nope"]),
    "shm_name": st.sampled_from(["", "kvstore-" + "0" * 32, "kvstore-" + "a" * 32 + "\n", "../../etc/passwd"]),
    "blocks": st.one_of(st.binary(max_size=16), st.just(bytes(LAYOUT.block_bytes))),
    "length_bytes": st.one_of(st.just(LAYOUT.block_bytes), st.integers(0, 2**64 - 1)),
}
#: The same, only values a server accepts: with them a message reaches past the first checks.
_VALID_HINTS: dict[str, st.SearchStrategy[Any]] = {
    "geometry": st.sampled_from(["", geometry.V4_1_FLASH.name]),
    "namespace": st.sampled_from(["", "default", "tenant-a"]),
    "shm_name": st.just("kvstore-" + "0" * 32),
    "blocks": st.just(bytes(LAYOUT.block_bytes)),
    "length_bytes": st.just(LAYOUT.block_bytes),
    "region_id": st.integers(0, 3),
    "offsets_bytes": st.integers(0, 3).map(lambda i: i * LAYOUT.block_bytes),
    "block_hashes": _HASH,
    "wait_ms": st.integers(0, 50),
}
#: Whole repeated fields, by name.
_LIST_HINTS: dict[str, st.SearchStrategy[Any]] = {
    "token_ids": st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=40),
                           st.integers(1, 3).map(lambda n: list(range(n * BLOCK_TOKENS)))),
}
#: Streams that stay open while the client wants them: read one answer, then hang up.
OPEN_ENDED = {"kvstore.v1.Transfer.OpenSession", "grpc.health.v1.Health.Watch"}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTS:
        lo, hi = _INTS[t]
        return st.integers(lo, hi)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if t == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=20)
    if t == FieldDescriptor.TYPE_BYTES:
        return _HASHES
    if t == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 100))
    raise AssertionError(f"no strategy for field type {t}")


def _field(field: FieldDescriptor, depth: int, valid: bool) -> st.SearchStrategy[Any]:
    hints = _VALID_HINTS if valid else _ELEMENT_HINTS
    if field.is_repeated and field.name in _LIST_HINTS:
        return _LIST_HINTS[field.name]
    if field.name in hints:
        one = hints[field.name]
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        one = messages(field.message_type, depth + 1, valid=valid)
    elif valid and field.type == FieldDescriptor.TYPE_BYTES:
        one = _HASH
    else:
        one = _scalar(field)
    if field.is_repeated:
        return st.lists(one, min_size=1 if valid else 0, max_size=4)
    return one


def messages(descriptor: Descriptor, depth: int = 0, *, valid: bool = False) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type, nested ones at most 3 deep: each field set or not,
    or (`valid`) every field set, from values that pass the first checks where a hint says."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    fields = {f.name: _field(f, depth, valid) for f in descriptor.fields}
    if valid:
        return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def near_valid_put() -> st.SearchStrategy[Message]:
    """Puts of the right shape (whole blocks of the right size), other fields at random."""
    @st.composite
    def build(draw: st.DrawFn) -> Message:
        n = draw(st.integers(1, 3))
        return kvstore_pb2.PutRequest(
            geometry=draw(_ELEMENT_HINTS["geometry"]), namespace=draw(_ELEMENT_HINTS["namespace"]),
            parent_hash=draw(st.one_of(st.just(b""), _HASHES)),
            token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * BLOCK_TOKENS,
                                    max_size=n * BLOCK_TOKENS + 3)),
            extra_keys=draw(st.lists(st.binary(max_size=40), max_size=3)),
            blocks=[os.urandom(LAYOUT.block_bytes) for _ in range(n)])
    return build()


def near_valid_swa_put() -> st.SearchStrategy[Message]:
    """SWA Puts of snapshots of the right size for their T (or for a T near it), their checksums
    right or not, other fields at random."""
    window = geometry.V4_1_FLASH.window

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        snaps = []
        for _ in range(draw(st.integers(1, 2))):
            position = draw(st.one_of(st.integers(1, 2 * window), st.sampled_from([0, 2**64 - 1])))
            sized_for = draw(st.one_of(st.just(max(position, 1)), st.integers(1, 2 * window)))
            data = os.urandom(snapshot_bytes(geometry.V4_1_FLASH, sized_for))
            snaps.append(swa_pb2.SwaSnapshot(key=draw(_HASHES), position=position, data=data,
                                             checksum=draw(st.one_of(st.just(checksum(data)), _scalar_of("fixed64")))))
        return swa_pb2.SwaPutRequest(namespace=draw(_ELEMENT_HINTS["namespace"]), snapshots=snaps,
                                     ttl_ms=draw(st.integers(0, 2**32 - 1)))
    return build()


def _scalar_of(kind: str) -> st.SearchStrategy[int]:
    return st.integers(0, 2**64 - 1) if kind == "fixed64" else st.integers(0, 2**32 - 1)


#: Near-valid messages, by request type: they reach the storage paths.
NEAR_VALID = {"kvstore.v1.PutRequest": near_valid_put, "kvstore.v1.SwaPutRequest": near_valid_swa_put}


def requests(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    """One request's bytes: mostly a built message (near-valid ones for Puts), else random bytes."""
    built = st.one_of(messages(method.input_type), messages(method.input_type, valid=True))
    if method.input_type.full_name in NEAR_VALID:
        built = st.one_of(built, NEAR_VALID[method.input_type.full_name]())
    encoded = built.map(lambda m: m.SerializeToString())
    return st.one_of(encoded, encoded, encoded, st.binary(max_size=200))


# -- calls ---------------------------------------------------------------------

def call(channel: grpc.Channel, method: MethodDescriptor, raw: list[bytes]) -> grpc.StatusCode:
    """Send `raw` to `method`; the status it ended with (OK when a stream was still answering)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if not method.server_streaming:
            if method.client_streaming:
                channel.stream_unary(path)(iter(raw), timeout=CALL_TIMEOUT_S)
            else:
                channel.unary_unary(path)(raw[0], timeout=CALL_TIMEOUT_S)
            return grpc.StatusCode.OK
        if method.client_streaming:
            stream = channel.stream_stream(path)(iter(raw), timeout=CALL_TIMEOUT_S)
        else:
            stream = channel.unary_stream(path)(raw[0], timeout=CALL_TIMEOUT_S)
        if method.full_name in OPEN_ENDED:
            next(stream, None)
            stream.cancel()  # it answered and would go on: the test hangs up
        else:
            for _ in stream:
                pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


@pytest.fixture
def channel(server: Any) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture
def session_id(channel: grpc.Channel) -> Iterator[str]:
    """A live Transfer session on `channel` (sessions belong to their connection)."""
    stream = channel.unary_stream("/kvstore.v1.Transfer/OpenSession",
                                  response_deserializer=transfer_pb2.SessionEvent.FromString)(
        transfer_pb2.OpenSessionRequest().SerializeToString())
    yield next(stream).session_id
    stream.cancel()


def assert_serving(server: Any) -> None:
    """The server is up and a good Put, Lookup and Get still round-trip."""
    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(server.target, namespace="after-fuzz") as client:
        tokens = list(range(client.block_tokens * 2))
        blocks = [os.urandom(client.block_bytes) for _ in range(2)]
        client.put(tokens, blocks)
        assert client.lookup(tokens).found_blocks == 2
        assert client.get(tokens).blocks == blocks


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_fuzzed_requests_get_a_clear_status(server: Any, channel: grpc.Channel, session_id: str,
                                            method: MethodDescriptor) -> None:
    has_session = "session_id" in method.input_type.fields_by_name

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        count = data.draw(st.integers(1, 3)) if method.client_streaming else 1
        raw = [data.draw(requests(method)) for _ in range(count)]
        if has_session and data.draw(st.integers(0, 3)):  # mostly: reach past the session check
            try:
                msg = message_factory.GetMessageClass(method.input_type).FromString(raw[0])
            except Exception:  # random bytes: left as they are
                msg = None
            if msg is not None:
                msg.session_id = session_id
                raw[0] = msg.SerializeToString()
        code = call(channel, method, raw)
        assert code not in NOT_CLEAR, f"{method.full_name} answered {code.name} to {raw!r:.300}"

    fuzz()
    assert_serving(server)
