"""A Put on the wire: one call for a short chain, a PutStream of batches for a long one.

`kvstore.client.store.Client.put` checks what the caller hands it, then sends it here. A
long chain's batches are chained by hashes computed locally, so each batch names its
parent without waiting for the previous answer, and the next batch's transfer overlaps
the server's fsync of this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvstore.client.blocks import encode_extra_keys
from kvstore.client.connection import Connection
from kvstore.prefix import ExtraKey, chain_hashes
from kvstore.v1 import kvstore_pb2 as pb


def put_blocks(connection: Connection, tokens: Sequence[int], payload: list[bytes], *, first_block: int,
               parent: bytes, extra_keys: Sequence[ExtraKey], step: int,
               on_batch: Callable[[int], None] | None, keep_until_s: float = 0.0) -> list[pb.PutResponse]:
    """Send `payload`, the blocks of `tokens` from block `first_block` on, `step` blocks a request.

    Args:
        connection: the store client's connection (its geometry, tenant and block size).
        tokens: the whole prompt's token ids.
        payload: one checked `block_bytes`-long block per full block from `first_block`.
        first_block: index of the first block sent.
        parent: the hash of block `first_block - 1` (b"" for the chain's first block).
        extra_keys: keys mixed into every block's hash.
        step: blocks per request; a longer payload goes as a PutStream, which stops at the
            first failed batch (the batches before it stay stored).
        on_batch: called with the number of blocks of each acknowledged batch of a stream.
        keep_until_s: pin the chain's last block (and so its prefix) until this Unix time, in the last
            request's own transaction (docs/RETENTION.md R22); 0: none. Not sent through a gateway
            (`Client.put` pins the whole chain there with a Lookup after the Put, R28).

    Returns:
        The server's replies, in order.

    Raises:
        KVStoreError: the class of the server's status.
    """
    extra = encode_extra_keys(extra_keys)
    if connection.run_blocks:  # a gateway: the fleet's chain, each request saying where its run starts
        return _put_through_gateway(connection, tokens, payload, first_block=first_block, extra_keys=extra_keys,
                                    extra=extra, step=step, on_batch=on_batch)
    if len(payload) <= step:
        request = _request(connection, tokens, payload, first_block, parent, extra)
        request.keep_until_s = keep_until_s
        return [connection.call(connection.kvstore.Put, request)]
    lo = first_block * connection.block_tokens
    chain = chain_hashes(tokens[lo: lo + len(payload) * connection.block_tokens],
                         block_tokens=connection.block_tokens, parent=parent or connection.root,
                         extra_keys=extra_keys)

    def requests() -> Iterator[pb.PutRequest]:
        for start in range(0, len(payload), step):
            before = parent if start == 0 else chain[start - 1]
            request = _request(connection, tokens, payload[start:start + step], first_block + start, before, extra)
            if start + step >= len(payload):  # the last batch pins the chain's last block (R22)
                request.keep_until_s = keep_until_s
            yield request

    replies: list[pb.PutResponse] = []
    for reply in connection.stream(connection.kvstore.PutStream, requests()):
        replies.append(reply)
        if on_batch is not None:
            on_batch(len(reply.block_hashes))
    return replies


def _request(connection: Connection, tokens: Sequence[int], blocks: list[bytes], first_block: int, parent: bytes,
             extra: list[bytes]) -> pb.PutRequest:
    lo = first_block * connection.block_tokens
    return pb.PutRequest(geometry=connection.geometry, namespace=connection.namespace, parent_hash=parent,
                         token_ids=tokens[lo: lo + len(blocks) * connection.block_tokens], extra_keys=extra,
                         blocks=blocks)


def _put_through_gateway(connection: Connection, tokens: Sequence[int], payload: list[bytes], *, first_block: int,
                         extra_keys: Sequence[ExtraKey], extra: list[bytes], step: int,
                         on_batch: Callable[[int], None] | None) -> list[pb.PutResponse]:
    """`put_blocks` through a fleet's gateway: parents are fleet hashes, and each request names its
    index, run key and bridge (GetInfoResponse.run_blocks; docs/FLEET.md F36)."""
    chain = connection.hashes(tokens[:(first_block + len(payload)) * connection.block_tokens],
                              extra_keys=extra_keys)

    def requests() -> Iterator[pb.PutRequest]:
        for start in range(first_block, first_block + len(payload), step):
            request = _request(connection, tokens, payload[start - first_block:start - first_block + step], start,
                               chain[start - 1] if start else b"", extra)
            for name, value in connection.run_fields(chain, start).items():
                setattr(request, name, value)
            yield request

    replies: list[pb.PutResponse] = []
    for reply in connection.stream(connection.kvstore.PutStream, requests()):
        replies.append(reply)
        if on_batch is not None:
            on_batch(len(reply.block_hashes))
    return replies
