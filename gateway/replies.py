"""Replies a servicer serializes itself, off the event loop, where they carry block bytes.

gRPC's event loop is one thread that every call shares. Building a protobuf reply
that holds a block and serializing it there copies the block twice on that thread
(into the message, then into its wire form). The methods that answer block bytes
(`Transfer.Fetch`, `KVStore.Get`) instead answer the wire bytes themselves, made on
the tier's pool while the blocks are copied out of LMDB (one copy), and their
handlers send those bytes as they are (`add_service`). Every reply is still the
message protobuf would write, byte for byte (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import grpc
from google.protobuf.message import Message

from kvstore.protowire import length_delimited, varint
from kvstore.v1 import kvstore_pb2 as pb

#: GetResponse's fields: index (1, varint), status (2, varint), data (3, bytes).
_FOUND_STATUS = bytes([2 << 3 | 0, pb.BLOCK_STATUS_FOUND])


def passthrough(reply: bytes | Message) -> bytes:
    """A handler's response serializer: bytes the servicer made go out as they are, a message is serialized."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def add_service(add: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server,
                presized: Collection[str], decoders: Mapping[str, Callable[[bytes], Any]] | None = None) -> None:
    """The service the generated `add` (`add_*Servicer_to_server`) registers, on `server`, with the
    methods named in `presized` answering through `passthrough`, and those named in `decoders`
    reading their requests with the decoder given (a Put's blocks left in place: gateway/put_request.py).

    Raises:
        ValueError: a name in `presized` or `decoders` is not one of the service's methods.
    """
    registered = _Registered()
    add(servicer, registered)
    decoders = decoders or {}
    unknown = (set(presized) | set(decoders)) - set(registered.handlers)
    if unknown:
        raise ValueError(f"{registered.service} has no method {sorted(unknown)}")
    handlers = {name: handler._replace(response_serializer=passthrough) if name in presized else handler
                for name, handler in registered.handlers.items()}
    for name, decode in decoders.items():
        handlers[name] = handlers[name]._replace(request_deserializer=decode)
    # Generic handlers only: grpc.aio's accept loop pays per registered method on every call (gateway/grpc_server.py).
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(registered.service, handlers),))


class _Registered:
    """Stands in for the server to keep what the generated code registers, to be changed first."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, _handlers: object) -> None:
        """The same handlers as `add_registered_method_handlers` gets: not needed twice."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Keep the service's handlers by method name."""
        self.service, self.handlers = service, handlers


def found_reply(index: int, data: memoryview) -> bytes:
    """A `GetResponse` of a FOUND block, serialized: the block's one copy (out of LMDB's map)."""
    index_field = b"\x08" + varint(index) if index else b""  # proto3 leaves a zero out
    return b"".join((index_field, _FOUND_STATUS, length_delimited(3, len(data)) if len(data) else b"", data))
