"""A use refreshes every copy: the fleet client's background refreshes of the replicas a read did not ask.

A Lookup or Get asks one replica of each run, which restarts that copy's
retention clock (R5). The other copies must not age as if unused, or one node
could evict a run another still keeps for a reader, so the last use that counts
is the latest over the copies (docs/FLEET.md, "Data path"). The client queues
(node, run, hashes used) for the replicas it did not ask and a thread of its own
sends them off the read path, batched: one Lookup without a lease per (node,
run) queued since the last round, for the deepest block used (a Lookup hit
refreshes its deepest found block, and R6/R7 keep the prefix under it: R5).
The same (node, run, depth) is not sent again within `min_gap_s` (the node would
not record a use less than a minute after the last anyway: R5's touch minute).
A refresh that fails is dropped and counted: its node is away, and a node that
comes back holding the run is refreshed by the next use.

A read from inside a run (a fleet session's descriptors, F71a) may not hold the
run's hashes from its first block: `add_at` queues the deepest block read by its
hash and depth in the run, sent as an anchored Lookup of it alone (the node finds
the block stored at that depth, A5, and refreshes it as a Lookup's deepest found).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import grpc

from kvstore.client.connection import status_error
from kvstore.client.fleet_nodes import NodePool
from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger(__name__)

#: A queued refresh: (chain, first, end, depth), `chain[first:end]` from the run's first block (depth end - first),
#: or `chain[end - 1]` alone at `depth` in its run.
_Refresh = tuple[Sequence[bytes], int, int, int]

#: Seconds before the same (node, run, depth) is refreshed again.
MIN_GAP_S = 60.0


class Refresher:
    """Refreshes of the copies a read did not ask, sent in batches on a background thread.

    Args:
        pool: the fleet's node connections.
        min_gap_s: seconds before the same (node, run, depth) is sent again.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self, pool: NodePool, *, min_gap_s: float = MIN_GAP_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool = pool
        self.min_gap_s = min_gap_s
        self._clock = clock
        self._cond = threading.Condition()
        #: (node, run key) -> (chain, first, end, depth): the run's hashes to the deepest block used (depth
        #: end - first), cut when sent; or that block alone, chain[end - 1] at `depth` (`add_at`).
        self._pending: dict[tuple[str, bytes], _Refresh] = {}
        self._sent_at: dict[tuple[str, bytes, int], float] = {}
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        #: Refresh calls sent, skipped (sent within min_gap_s), failed.
        self.sent = self.skipped = self.failed = 0

    def add(self, node_id: str, run_hashes: Sequence[bytes]) -> None:
        """Queue a refresh of `run_hashes` (a run's hashes from its first, to the deepest block used) on `node_id`."""
        self.add_many([(node_id, run_hashes, 0, len(run_hashes))])

    def add_many(self, refreshes: Iterable[tuple[str, Sequence[bytes], int, int]]) -> None:
        """Queue many refreshes at once, each (node, chain, first, end): `chain[first:end]` on that node.

        One lock and one wake of the thread for them all, and the hashes are cut from `chain` by the
        thread, not here: a Lookup of a 1M-token prompt queues ~120 of them on its read path. `chain`
        must not change after the call (the callers' chains are their own lists).
        """
        with self._cond:
            if self._closed:
                return
            for node_id, chain, first, end in refreshes:
                if end <= first:
                    continue
                self._queue((node_id, bytes(chain[first])), (chain, first, end, end - first))
            self._wake()

    def add_at(self, node_id: str, run_key: bytes, block_hash: bytes, depth: int) -> None:
        """Queue a refresh on `node_id` of the block `block_hash`, `depth` deep in the run keyed `run_key` (1 + its
        index in the run): a read from inside the run, which need not hold the hashes above it (F71a)."""
        with self._cond:
            if self._closed or depth < 1:
                return
            self._queue((node_id, run_key), ((bytes(block_hash),), 0, 1, depth))
            self._wake()

    def _queue(self, key: tuple[str, bytes], refresh: _Refresh) -> None:
        """One refresh queued (under the lock): the deepest of those queued for the same (node, run) is kept."""
        held = self._pending.get(key)
        if held is None or refresh[3] > held[3]:
            self._pending[key] = refresh

    def _wake(self) -> None:
        """The thread started if need be and woken (under the lock) when anything is queued."""
        if not self._pending:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fleet-refresh", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                batch, self._pending = self._pending, {}
                self._busy = True
            try:
                self._send(batch)
            except Exception:  # a bug must not end the refreshes silently
                log.exception("fleet: sending refreshes failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, batch: dict[tuple[str, bytes], _Refresh]) -> None:
        now = self._clock()
        calls = []
        for (node_id, run_key), (chain, first, end, depth) in batch.items():
            memo = (node_id, run_key, depth)
            if now - self._sent_at.get(memo, -self.min_gap_s) < self.min_gap_s:
                self.skipped += 1
                continue
            try:
                c = self.pool.connection(node_id)
                if depth == end - first:  # the run's hashes from its first block
                    request = pb.LookupRequest(
                        geometry=c.geometry, namespace=c.namespace, block_hashes_packed=b"".join(chain[first:end])
                    )
                else:  # the block alone, anchored at its depth (A5): it stands for the run above it
                    request = pb.LookupRequest(
                        geometry=c.geometry, namespace=c.namespace, anchor_hash=chain[end - 1], anchor_blocks=depth
                    )
                calls.append((memo, c.kvstore.Lookup.future(request, timeout=c.timeout_s, metadata=c.metadata)))
            except KVStoreError as exc:
                self._dropped(node_id, exc)
        for memo, call in calls:  # sent at once, then awaited: one round trip for the whole batch
            try:
                call.result()
                self._sent_at[memo] = now
                self.sent += 1
            except grpc.RpcError as exc:
                self._dropped(memo[0], status_error(exc))

    def _dropped(self, node_id: str, exc: KVStoreError) -> None:
        self.failed += 1
        log.debug("fleet: refresh on node %s dropped: %s", node_id, exc.message)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued refresh was sent (or dropped); False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for at most `timeout_s`), then end the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
