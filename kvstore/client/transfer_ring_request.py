"""A ring request's bytes for a read into consecutive slots, written as protobuf writes them, and
its all-DONE answer recognised by its bytes: the ring's lean client path (`kvstore.client.transfer_ring`)
builds and parses no protobuf message per fetch.

A `Template` is made once per read shape (region, first offset, count, block size, prefix_only);
`head + hashes + tail` is the `SubmitRequest` that `SerializeToString` would write for it
(`test_a_ring_template_writes_what_protobuf_writes`).
"""

from __future__ import annotations

from kvstore.prefix import HASH_BYTES
from kvstore.protowire import varint
from kvstore.transfer import DONE, TransferState
from kvstore.v1 import transfer_pb2 as pb


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field as protobuf writes it (omitted when empty, as proto3 omits it)."""
    return bytes([number << 3 | 2]) + varint(len(payload)) + payload if payload else b""


def _scalar(number: int, value: int) -> bytes:
    """A varint field as protobuf writes it (omitted when zero)."""
    return bytes([number << 3]) + varint(value) if value else b""


class Template:
    """A consecutive-slots read's `SubmitRequest` bytes, but for its hashes: `head + hashes + tail`
    is what `SerializeToString` writes for the same request (`test_a_ring_template_writes_what_protobuf_writes`).

    Args:
        region_id, offset_bytes, n, block_bytes, prefix_only: the read's shape.
    """

    __slots__ = ("answer", "head", "statuses", "tail")

    def __init__(self, region_id: int, offset_bytes: int, n: int, block_bytes: int, prefix_only: bool) -> None:
        offsets = b"".join(varint(offset_bytes + i * block_bytes) for i in range(n))
        hashes_at = _scalar(1, region_id) + _scalar(2, block_bytes) + bytes([3 << 3 | 2]) + varint(n * HASH_BYTES)
        group = len(hashes_at) + n * HASH_BYTES + len(_field(4, offsets))
        self.head = (_scalar(2, pb.TRANSFER_OP_READ) + _scalar(4, int(prefix_only)) + bytes([9 << 3 | 2])
                     + varint(group) + hashes_at)
        self.tail = _field(4, offsets)
        #: The all-DONE answer (done, every byte DONE, every block's bytes), as protobuf writes it.
        self.statuses = bytes([DONE]) * n
        self.answer = pb.TransferState(done=True, bytes_moved=n * block_bytes,
                                       statuses=self.statuses).SerializeToString()


#: Templates kept per shape; a worker reads a handful of shapes again and again.
TEMPLATES_KEPT = 64


def all_done(statuses: bytes, block_bytes: int) -> TransferState:
    """The all-DONE state of a read, built without the frozen dataclass's `__init__` (its seven
    `object.__setattr__` calls cost ~3 us on a loaded box: a tenth of a ring fetch's client time)."""
    state = object.__new__(TransferState)
    state.__dict__.update(transfer_id=0, done=True, statuses=statuses, bytes_moved=len(statuses) * block_bytes,
                          block_bytes=block_bytes, failures={}, block_hashes=b"")
    return state
