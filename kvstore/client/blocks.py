"""The KVStore service's block calls that the store client and the transfer stream path both make."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore.client import arguments
from kvstore.client.connection import Connection
from kvstore.prefix import ExtraKey
from kvstore.v1 import kvstore_pb2 as pb


def encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> list[bytes]:
    """Extra keys as the wire carries them (str as UTF-8)."""
    return [k.encode() if isinstance(k, str) else bytes(k) for k in extra_keys]


def stream_blocks(connection: Connection, hashes: Sequence[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """Fetch blocks by hash as they arrive: (index, status, data) per block, in
    order, across as many Get calls as the batch limit needs. `status` is a
    `kvstore.v1.kvstore_pb2.BlockStatus`; `data` is empty unless found."""
    hashes = arguments.hashes(hashes, "hashes")
    step = connection.batch_blocks
    for start in range(0, len(hashes), step):
        request = pb.GetRequest(geometry=connection.geometry, namespace=connection.namespace,
                                block_hashes=hashes[start:start + step])
        for reply in connection.stream(connection.kvstore.Get, request):
            yield start + reply.index, reply.status, reply.data
