"""A Put on the wire: one call for a short chain, a PutStream of batches for a long one, and a large
put to a node over the one-copy TCP transport where the server offers it (kvstore/client/put_tcp.py:
the same requests, the blocks sent from their buffers; gRPC when it is not offered).

`kvstore.client.store.Client.put` checks what the caller hands it, then sends it here. A
long chain's batches are chained by hashes computed locally, so each batch names its
parent without waiting for the previous answer, and the next batch's transfer overlaps
the server's fsync of this one.

Requests are serialized here (`encode`), not by protobuf: protobuf's serialization copies
each block into its own arena first, and for a batch of 64 V4.1 blocks (3.6 MB) that cost
20-30 ms on the dev box (its allocator handing the pages back to the kernel and faulting
them in again every batch), most of a commit's fsync; joining the same bytes costs 0.2 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.client import put_tcp
from kvstore.client.blocks import encode_extra_keys
from kvstore.client.connection import Connection
from kvstore.prefix import ExtraKey, chain_hashes
from kvstore.protowire import length_delimited
from kvstore.v1 import kvstore_pb2 as pb

#: PutRequest's blocks field: the fields numbered below it go before the blocks, the others after.
_BLOCKS = pb.PutRequest.DESCRIPTOR.fields_by_name["blocks"]
_PUT = "/kvstore.v1.KVStore/Put"
_PUT_STREAM = "/kvstore.v1.KVStore/PutStream"


def encode(request: pb.PutRequest, blocks: Sequence[Any]) -> bytes:
    """`request` with `blocks` (bytes-like) as its blocks field, serialized: the bytes protobuf would write
    for it (fields in number order), each block copied once, into the result."""
    low, high = pb.PutRequest(), pb.PutRequest()
    for field, value in request.ListFields():
        if field.number == _BLOCKS.number:
            raise ValueError("encode takes the blocks apart from the request")
        part = low if field.number < _BLOCKS.number else high
        if field.is_repeated:
            getattr(part, field.name).extend(value)
        else:
            setattr(part, field.name, value)
    parts: list[Any] = [low.SerializeToString()]
    tags: dict[int, bytes] = {}
    for block in blocks:
        size = memoryview(block).nbytes
        tag = tags.get(size)
        if tag is None:
            tag = tags[size] = length_delimited(_BLOCKS.number, size)
        parts += (tag, block)
    parts.append(high.SerializeToString())
    return b"".join(parts)


def _raw_method(connection: Connection, name: str, streaming: bool) -> Any:
    """The Put or PutStream method of the connection's channel, sending requests `encode` serialized."""
    make = connection.channel.stream_stream if streaming else connection.channel.unary_unary
    return make(name, request_serializer=None, response_deserializer=pb.PutResponse.FromString)


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
            first failed batch (the batches before it stay stored). A node's payload of
            `put_tcp.TCP_PUT_MIN_BYTES` or more goes over the TCP transport where the server
            offers it (its frames as the stream's requests, at most its frame limit each).
        on_batch: called with the number of blocks of each acknowledged batch of a stream.
        keep_until_s: pin the chain's last block (and so its prefix) until this Unix time, in the last
            request's own transaction (docs/RETENTION.md R22); 0: none. Through a gateway the requests
            that end at a run's end (or the payload's) carry it: the gateway passes it to each copy's Put of
            each run part, which pins the part's last block in its own transaction (R28), once per run.

    Returns:
        The server's replies, in order.

    Raises:
        KVStoreError: the class of the server's status.
    """
    extra = encode_extra_keys(extra_keys)
    if connection.run_blocks:  # a gateway: the fleet's chain, each request saying where its run starts
        return _put_through_gateway(connection, tokens, payload, first_block=first_block, extra_keys=extra_keys,
                                    extra=extra, step=step, on_batch=on_batch, keep_until_s=keep_until_s)
    block_bytes = len(payload[0]) if payload else 0
    if put_tcp.wanted(connection, len(payload) * block_bytes):
        grant = put_tcp.open_put(connection)
        if grant is not None:  # the blocks sent from their buffers (kvstore/client/put_tcp.py)
            step = min(step, max(1, grant.max_frame_bytes // block_bytes))
            frames = _node_requests(connection, tokens, payload, first_block=first_block, parent=parent,
                                    extra_keys=extra_keys, extra=extra, step=step, keep_until_s=keep_until_s)
            sent = put_tcp.send(connection, grant, frames, -(-len(payload) // step), on_batch)
            if sent is not None:
                return sent
    if len(payload) <= step:
        request = _request(connection, tokens, payload, first_block, parent, extra)
        request.keep_until_s = keep_until_s
        return [connection.call(_raw_method(connection, _PUT, False), encode(request, payload))]
    frames = _node_requests(connection, tokens, payload, first_block=first_block, parent=parent,
                            extra_keys=extra_keys, extra=extra, step=step, keep_until_s=keep_until_s)
    replies: list[pb.PutResponse] = []
    requests = (encode(request, blocks) for request, blocks in frames)
    for reply in connection.stream(_raw_method(connection, _PUT_STREAM, True), requests):
        replies.append(reply)
        if on_batch is not None:
            on_batch(len(reply.block_hashes))
    return replies


def _node_requests(connection: Connection, tokens: Sequence[int], payload: list[bytes], *, first_block: int,
                   parent: bytes, extra_keys: Sequence[ExtraKey], extra: list[bytes], step: int,
                   keep_until_s: float) -> Iterator[tuple[pb.PutRequest, list[bytes]]]:
    """A node's put as requests of `step` blocks, each without its blocks and with them; the last carries the pin.

    Each batch's parent is the last hash of the batch before: hashed as its request is built, so the first
    request goes out without waiting for the whole chain (589 blocks: ~14 ms on the dev box, before anything
    reached the server; docs/BENCHMARKS.md, `bench store`). The first batch is hashed here, before the call,
    so a bad parent or extra key is refused before anything is sent, as when the whole chain was.
    """
    bt, lo = connection.block_tokens, first_block * connection.block_tokens
    last = chain_hashes(tokens[lo: lo + min(step, len(payload)) * bt], block_tokens=bt,
                        parent=parent or connection.root, extra_keys=extra_keys)[-1]

    def requests() -> Iterator[tuple[pb.PutRequest, list[bytes]]]:
        before, end = parent, last  # the request's parent, the hash of its last block
        for start in range(0, len(payload), step):
            if start:
                before = end
                end = chain_hashes(tokens[lo + start * bt: lo + (start + step) * bt], block_tokens=bt, parent=before,
                                   extra_keys=extra_keys)[-1]
            blocks = payload[start:start + step]
            request = _request(connection, tokens, blocks, first_block + start, before, extra)
            if start + step >= len(payload):  # the last batch pins the chain's last block (R22)
                request.keep_until_s = keep_until_s
            yield request, blocks

    return requests()


def _request(connection: Connection, tokens: Sequence[int], blocks: list[bytes], first_block: int, parent: bytes,
             extra: list[bytes]) -> pb.PutRequest:
    """The request for `blocks`, without them (`encode` adds them)."""
    lo = first_block * connection.block_tokens
    return pb.PutRequest(geometry=connection.geometry, namespace=connection.namespace, parent_hash=parent,
                         token_ids=tokens[lo: lo + len(blocks) * connection.block_tokens], extra_keys=extra)


def _put_through_gateway(connection: Connection, tokens: Sequence[int], payload: list[bytes], *, first_block: int,
                         extra_keys: Sequence[ExtraKey], extra: list[bytes], step: int,
                         on_batch: Callable[[int], None] | None, keep_until_s: float = 0.0) -> list[pb.PutResponse]:
    """`put_blocks` through a fleet's gateway: parents are fleet hashes, and each request names its
    index, run key and bridge (GetInfoResponse.run_blocks; docs/FLEET.md F36). With `keep_until_s`, requests
    end at runs' ends where they can, and each that ends at one (or at the payload's end) carries the pin: the
    gateway passes it to each copy's Put of each run part, pinning the part's last block in that Put (R28).
    So each run's last stored block is pinned once, never a block inside it that a later request extends
    (each pin charges its prefix to the tenant's budget, R24)."""
    chain = connection.hashes(tokens[:(first_block + len(payload)) * connection.block_tokens],
                              extra_keys=extra_keys)
    end, rb = first_block + len(payload), connection.run_blocks

    def spans() -> Iterator[tuple[int, int]]:
        start = first_block
        while start < end:
            stop = min(start + step, end)
            if keep_until_s and stop < end and stop % rb and stop - stop % rb > start:
                stop -= stop % rb  # end at a run's end, so the request's last part is a whole run's tail
            yield start, stop
            start = stop

    def requests() -> Iterator[bytes]:
        for start, stop in spans():
            blocks = payload[start - first_block:stop - first_block]
            request = _request(connection, tokens, blocks, start, chain[start - 1] if start else b"", extra)
            for name, value in connection.run_fields(chain, start).items():
                setattr(request, name, value)
            if stop == end or stop % rb == 0:  # a request ending inside a run (step < run_blocks) pins nothing
                request.keep_until_s = keep_until_s
            yield encode(request, blocks)

    replies: list[pb.PutResponse] = []
    for reply in connection.stream(_raw_method(connection, _PUT_STREAM, True), requests()):
        replies.append(reply)
        if on_batch is not None:
            on_batch(len(reply.block_hashes))
    return replies
