"""Fetch: blocks by hash with their bytes in one reply, for clients on another host.

The server's work per call is per batch, not per block in Python: one read
transaction looks the blocks up, the native verify-and-copy loop
(`kvstore.native.blockcopy`, without the GIL) checks each against its checksum and copies
it into one buffer, and that buffer is the reply's `data`. A client stripes a
large fetch over several calls at once (`kvstore.client.transfer_stream`), so
several copy threads and several HTTP/2 streams work together.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.native import blockcopy
from kvstore.prefix import HASH_BYTES, BlockScope
from kvstore.protowire import length_delimited
from kvstore.transfer import DONE, FAILED, MISSING, SKIPPED, BatchResults
from kvstore.v1 import transfer_pb2 as pb
from tiers.store import MappedStore

#: `blockcopy` result code -> transfer status code (0: not reached, SKIPPED once a prefix stopped).
_CODES = bytes.maketrans(bytes([blockcopy.NOT_REACHED, blockcopy.FOUND, blockcopy.MISSING, blockcopy.CORRUPT]),
                         bytes([SKIPPED, DONE, MISSING, FAILED]))
CORRUPT_REASON = "the stored block failed its checksum and was dropped"


@dataclass(frozen=True, kw_only=True)
class Fetched:
    """A fetch's results: `results` per block, `wire` its `FetchReply` serialized (the DONE
    blocks' bytes in order as `data`), `found` how many are DONE."""

    results: BatchResults
    wire: bytes
    found: int


def fetch_keys(scope: BlockScope, block_hashes: bytes, *, block_bytes: int, max_blocks: int,
               max_bytes: int) -> list[bytes]:
    """The storage keys of a Fetch's hashes, checked whole.

    Raises:
        InvalidArgument: the hashes are not whole 32-byte hashes, none, more than
            `max_blocks`, or more bytes than `max_bytes` (the message limit).
    """
    n, extra = divmod(len(block_hashes), HASH_BYTES)
    if extra or not n:
        raise InvalidArgument(f"block_hashes holds {len(block_hashes)} bytes; send 1 or more {HASH_BYTES}-byte "
                              "hashes, concatenated")
    most = min(max_blocks, max(max_bytes // block_bytes, 1))
    if n > most:
        raise InvalidArgument(f"a fetch holds at most {most} blocks (transfer.max_descriptors and the message "
                              f"limit at {block_bytes} bytes a block); got {n}", hint="stripe it over several calls")
    prefix = scope.prefix
    return [prefix + block_hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES] for i in range(n)]


def copy_blocks(tier: MappedStore, keys: list[bytes], buffer: memoryview, block_bytes: int, prefix_only: bool
                ) -> tuple[bytes, list[bytes]]:
    """Look `keys` up in one read txn and verify-copy block i into `buffer[i * block_bytes:]` (on
    the tier's pool): Fetch's reply buffer, or a bulk staging slot.

    Returns:
        A `blockcopy` code per key, and the keys of found blocks due a retention refresh.
    """
    dests: list[memoryview | None] = [buffer[i * block_bytes:(i + 1) * block_bytes] for i in range(len(keys))]
    due: list[bytes] = []
    staged = tier.stage_reads(keys)
    try:
        codes = staged.copy(dests, prefix_only, touch_due=due)
    finally:
        staged.close()
        dests.clear()
    return codes, due


def batch_results(codes: bytes, block_bytes: int) -> BatchResults:
    """A fetch's statuses and failures from its `blockcopy` codes (a corrupt block: DATA_LOSS)."""
    results = BatchResults(len(codes))
    results.statuses[:] = codes.translate(_CODES)
    for i in np.flatnonzero(np.frombuffer(codes, dtype=np.uint8) == blockcopy.CORRUPT).tolist():
        results.fail(i, "DATA_LOSS", CORRUPT_REASON)
    results.bytes_moved = codes.count(blockcopy.FOUND) * block_bytes
    return results


def read_blocks(tier: MappedStore, keys: list[bytes], block_bytes: int, prefix_only: bool
                ) -> tuple[Fetched, list[bytes]]:
    """Look `keys` up in one read txn and verify-copy them into the reply (on the tier's pool).

    The blocks are copied straight into the serialized `FetchReply` (statuses,
    then data), laid out for the usual case where every block is found: the
    reply then costs one copy of the bytes here and none on the event loop.
    Otherwise only the DONE blocks travel, and the reply is built again.

    Returns:
        The fetch, and the keys of DONE blocks due a retention refresh.
    """
    n = len(keys)
    statuses_tag, data_tag = length_delimited(1, n), length_delimited(2, n * block_bytes)
    data_at = len(statuses_tag) + n + len(data_tag)

    def fill(view: memoryview) -> tuple[bytes, list[bytes], BatchResults]:
        view[:len(statuses_tag)] = statuses_tag
        view[data_at - len(data_tag):data_at] = data_tag
        codes, due = copy_blocks(tier, keys, view[data_at:], block_bytes, prefix_only)
        results = batch_results(codes, block_bytes)
        view[len(statuses_tag):len(statuses_tag) + n] = results.statuses
        return codes, due, results

    wire, (codes, due, results) = blockcopy.fill_bytes(data_at + n * block_bytes, fill)
    found = codes.count(blockcopy.FOUND)
    if found < n:  # only the DONE blocks travel, with the failures
        data = b"".join(wire[data_at + i * block_bytes:data_at + (i + 1) * block_bytes]
                        for i in range(n) if codes[i] == blockcopy.FOUND)
        wire = pb.FetchReply(statuses=bytes(results.statuses), data=data, failures=[
            pb.DescriptorFailure(index=i, code=code, reason=reason)
            for i, (code, reason) in sorted(results.failures.items())]).SerializeToString()
    return Fetched(results=results, wire=wire, found=found), due


async def fetch(tier: MappedStore, keys: list[bytes], block_bytes: int, prefix_only: bool) -> Fetched:
    """Read `keys` on the tier's pool, then restart the DONE blocks' retention clocks durably.

    A refresh that fails fails the call (its KVStoreError), as it fails a Get:
    a client never holds bytes whose retention the store did not record.
    """
    fetched, due = await tier.call(read_blocks, tier, keys, block_bytes, prefix_only)
    if due:
        await asyncio.wrap_future(tier.touch_soon(due))
    return fetched
