"""A Put's request as received: the blocks left where gRPC put them, the other fields parsed by protobuf.

grpc.aio hands a method's deserializer the whole message as one bytes object. Protobuf's parse
copies every block into its own arena, and reading `request.blocks` copies each again into a
bytes object: two copies of a 3.6 MB batch before LMDB's own, the first on the event loop
(docs/BENCHMARKS.md, the Put budget of session 23). `decode` instead walks the message's
top-level fields (a few dozen: the blocks and a handful of small fields), takes each block as
a memoryview of the received bytes, and lets protobuf parse what remains (tokens, hashes,
names: kilobytes), so every field but the blocks means exactly what protobuf says it means.

Anything the walk does not expect (a group, a truncated field, a varint past 64 bits) is left
to protobuf's own parse of the whole message, so a bad message is refused with protobuf's
error, as before (gateway/undecodable.py turns it into INVALID_ARGUMENT).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError

from kvstore.protowire import read_varint
from kvstore.v1 import kvstore_pb2 as pb

#: PutRequest's blocks field number.
BLOCKS_FIELD = pb.PutRequest.DESCRIPTOR.fields_by_name["blocks"].number
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class PutRequestView:
    """A PutRequest whose `blocks` are views of the received message; every other field is
    the parsed message's (attribute access is passed on to it).

    Attributes:
        blocks: each block's bytes, a read-only memoryview of the message gRPC received (which
            it keeps alive), in order.
        message: the other fields, parsed by protobuf (its own `blocks` is empty).
    """

    __slots__ = ("blocks", "message")

    def __init__(self, message: pb.PutRequest, blocks: list[memoryview]) -> None:
        self.message = message
        self.blocks = blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def to_message(self) -> pb.PutRequest:
        """The request as one protobuf message (its blocks copied in)."""
        full = pb.PutRequest()
        full.CopyFrom(self.message)
        full.blocks.extend(bytes(b) for b in self.blocks)
        return full


def decode(raw: bytes) -> PutRequestView:
    """The PutRequest serialized in `raw`, its blocks not copied (module docstring).

    Raises:
        google.protobuf.message.DecodeError: `raw` is not a PutRequest (protobuf's own verdict).
    """
    spans = _block_spans(raw)
    if spans is None:  # something the walk does not handle: protobuf decides, blocks copied as before
        message = pb.PutRequest.FromString(raw)
        blocks = [memoryview(b) for b in message.blocks]
        del message.blocks[:]
        return PutRequestView(message, blocks)
    view = memoryview(raw)
    rest: list[Any] = []
    blocks = []
    kept = 0  # where the bytes not yet given to `rest` start
    for field_at, data_at, end in spans:
        if field_at > kept:
            rest.append(view[kept:field_at])
        blocks.append(view[data_at:end])
        kept = end
    if not blocks:
        message = pb.PutRequest.FromString(raw)
    else:
        rest.append(view[kept:])
        message = pb.PutRequest.FromString(b"".join(rest))
    return PutRequestView(message, blocks)


def from_frame(header: memoryview, data: memoryview, count: int, block_bytes: int) -> PutRequestView:
    """A put frame of the TCP transport (`kvstore.transfer_tcp_wire`): `header` a PutRequest without
    blocks, `data` its `count` blocks of `block_bytes` each, concatenated. The blocks are views of
    `data`, valid while the buffer under it is not reused (until the batch's commit has returned).

    Raises:
        google.protobuf.message.DecodeError: `header` is not a PutRequest, or it holds blocks itself.
    """
    message = pb.PutRequest.FromString(bytes(header))  # kilobytes: the token ids and a few names
    if message.blocks:
        raise DecodeError(f"the header holds {len(message.blocks)} blocks of its own (they follow it)")
    return PutRequestView(message, [data[i * block_bytes:(i + 1) * block_bytes] for i in range(count)])


def _block_spans(raw: bytes) -> list[tuple[int, int, int]] | None:
    """(field start, data start, end) of each blocks field in `raw`, in order; None where the walk
    meets what it leaves to protobuf (a group, a bad wire type, a field running past the end)."""
    spans: list[tuple[int, int, int]] = []
    at, size = 0, len(raw)
    try:
        while at < size:
            field_at = at
            tag, at = read_varint(raw, at)
            wire = tag & 7
            if wire == _LENGTH_DELIMITED:
                length, at = read_varint(raw, at)
                end = at + length
                if end > size:
                    return None
                if tag >> 3 == BLOCKS_FIELD:
                    spans.append((field_at, at, end))
                at = end
            elif wire == _VARINT:
                _, at = read_varint(raw, at)
            elif wire == _FIXED64:
                at += 8
            elif wire == _FIXED32:
                at += 4
            else:
                return None
    except (IndexError, ValueError):
        return None
    return spans  # a fixed-size field running past the end stays in what protobuf parses: it refuses it
