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


def stream_blocks(connection: Connection, hashes: Sequence[bytes], *, chain: Sequence[bytes] = (),
                  first_block: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """Fetch blocks by hash as they arrive: (index, status, data) per block, in
    order, across as many Get calls as the batch limit needs. `status` is a
    `kvstore.v1.kvstore_pb2.BlockStatus`; `data` is empty unless found.

    Through a gateway (`connection.run_blocks`), `hashes` are blocks from `first_block`
    of `chain` (the fleet hashes from block 0; `hashes` itself when `first_block` is 0):
    each request says where it starts, so the gateway finds its run."""
    hashes = arguments.hashes(hashes, "hashes")
    step = connection.batch_blocks
    chain = chain or hashes
    for start in range(0, len(hashes), step):
        request = pb.GetRequest(geometry=connection.geometry, namespace=connection.namespace,
                                block_hashes=hashes[start:start + step])
        if connection.run_blocks:
            fields = connection.run_fields(chain, first_block + start)
            request.first_block, request.run_key = fields["first_block"], fields.get("run_key", b"")
        for reply in connection.stream(connection.kvstore.Get, request):
            yield start + reply.index, reply.status, reply.data
