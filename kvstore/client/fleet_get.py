"""A Get in a fleet: each run from its nearest live replica, falling over to the next on a failure or a miss.

A run's blocks stream from the first replica of its read order
(`NodePool.read_order`: this host's, else this client's draw). When that node
fails the call (UNAVAILABLE, DEADLINE_EXCEEDED, DATA_LOSS) or answers a block
MISSING or CORRUPT (a copy lost, or not yet re-replicated), the rest of the run
is asked of the next replica from that block on; blocks already delivered are
not asked again. When a replica could not answer, the retry policy backs off
and asks them all again. When every replica that answered lacks a block, it and
the rest of its run are MISSING (R6 within a run: nothing after a missing block
is stored on that node); when none answered after the policy's last round, the
error is raised. The replicas not asked are
queued for a refresh of what was read (`fleet_refresh`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.client import fleet_metrics
from kvstore.client.blocks import stream_blocks
from kvstore.client.fleet_lookup import FAIL_OVER
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.fleet_refresh import Refresher
from kvstore.client.retry import Retry
from kvstore.errors import KVStoreError
from kvstore.fleet.placement import RunPlacement
from kvstore.v1 import kvstore_pb2 as pb

Block = tuple[int, int, bytes]


@dataclass(kw_only=True)
class RunRead:
    """Where one run's read stands."""

    #: The next block (chain index) to deliver.
    next_block: int
    #: The worst status a replica answered for `next_block` (0: none answered it).
    status: int = 0
    #: The last error a replica failed with this round.
    error: KVStoreError | None = None
    #: The replica that served the last block delivered.
    served_by: str | None = None


def stream_runs(pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes], *, first_block: int,
                end_block: int, retry: Retry, refresher: Refresher) -> Iterator[Block]:
    """(index, status, data) for blocks [first_block, end_block) of `chain`, index counted from `first_block`.

    Raises:
        KVStoreError: no replica of a run answered after the retry policy's rounds, or a node refused the
            request for a reason every replica would share.
    """
    for run in runs:
        lo, hi = max(run.first_block, first_block), min(run.end_block, end_block)
        if lo < hi:
            yield from _stream_run(pool, run, chain, lo, hi, first_block, retry, refresher)


def stream_run_part(pool: NodePool, run: RunPlacement, run_key: bytes, hashes: Sequence[bytes], *,
                    retry: Retry, refresher: Refresher | None, run_offset: int = 0) -> Iterator[Block]:
    """(index, status, data) for `hashes`, blocks of one run from somewhere inside it (a gateway's Get:
    `run_key` is the run's first hash), read with failover as `stream_runs`. With a `refresher` the copies not
    read are refreshed: by the hashes from the run's first block when `hashes` start there (`run_offset` 0),
    else, `hashes[0]` being block `run_offset` of the run, at the deepest block read, anchored at its depth
    (F68a: `Refresher.add_at`, as a descriptor read from inside a run, F71a)."""
    yield from _stream_run(pool, run, hashes, 0, len(hashes), 0, retry, refresher, run_key=run_key,
                           run_offset=run_offset)


def _stream_run(pool: NodePool, run: RunPlacement, chain: Sequence[bytes], lo: int, hi: int, base: int,
                retry: Retry, refresher: Refresher | None, *, run_key: bytes | None = None,
                run_offset: int = 0) -> Iterator[Block]:
    order = pool.read_order(run_key or chain[run.first_block], run.replicas)
    read = RunRead(next_block=lo)
    retries = 0
    while read.next_block < hi:
        read.status, read.error = 0, None
        for i, node in enumerate(order):
            if read.next_block >= hi:
                break
            if i:  # the replica before failed or lacked the block: the run's read moves on
                fleet_metrics.failover("get")
            yield from _from_replica(pool, node, chain, read, hi, base)
        if read.next_block >= hi:
            break
        if read.error is not None and retries < retry.retries and retry.retries_on(read.error):
            retries += 1  # a replica could not answer: back off, then ask them all again
            fleet_metrics.retry_round("get")
            retry.pause(retries)
            continue
        if read.status:  # every replica that answered lacks this block: the rest of the run is not loadable
            for i in range(read.next_block, hi):
                yield i - base, read.status if i == read.next_block else pb.BLOCK_STATUS_MISSING, b""
            break
        assert read.error is not None
        raise read.error
    if read.served_by is not None and refresher is not None:
        others = [other for other in run.replicas if other != read.served_by]
        if run_offset:  # from inside the run (F68a): its deepest block read, at its depth in the run
            assert run_key is not None
            for other in others:
                refresher.add_at(other, run_key, chain[read.next_block - 1], run_offset + read.next_block)
            return
        used = chain[run.first_block:read.next_block]
        for other in others:
            refresher.add(other, used)


def _from_replica(pool: NodePool, node: str, chain: Sequence[bytes], read: RunRead, hi: int,
                  base: int) -> Iterator[Block]:
    """Deliver what `node` holds of blocks [read.next_block, hi), up to its first miss or failure."""
    start = read.next_block
    try:
        for index, status, data in stream_blocks(pool.connection(node), chain[start:hi]):
            if status != pb.BLOCK_STATUS_FOUND:
                read.status = max(read.status, status)  # CORRUPT (3) above MISSING (2)
                return
            yield start + index - base, status, data
            read.next_block, read.served_by, read.status = start + index + 1, node, 0
    except KVStoreError as exc:
        if not isinstance(exc, FAIL_OVER):
            raise
        pool.failed(node)
        read.error = exc
