"""A gateway's store: the fleet's router behind the KVStore servicer (`kvstore gateway`, docs/FLEET.md F36-F40).

It holds no blocks and no state that outlives it: the membership view (from etcd),
node connections per caller (soft state, rebuilt on demand), a thread pool. Every
call is routed as the fleet client routes it (`kvstore/client/fleet_*.py`, the same
code): a Lookup across the runs with one composite lease, a Put to every replica of
each run (acknowledged once every copy is durable), a Get from each run's nearest
replica with failover. Killing a gateway loses nothing a client was told is stored:
that is on the nodes.

Of `tiers.store.BlockStore` it serves what needs no storage key; the key-level
methods (reads by key, refreshes, stats, usage) answer FAILED_PRECONDITION naming
where to go: a node serves them, and the transfer paths need a node's LMDB map.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, TypeVar

from gateway.block_feed import Feed, produce
from gateway.fleet_stats import merge_stats
from gateway.routed_store import Route, StoredTail
from gateway.validate import RunPart
from kvstore.client.connection import TlsOptions
from kvstore.client.fleet_address import FleetAddress
from kvstore.client.fleet_get import stream_run_part
from kvstore.client.fleet_lookup import FoundChains, lookup_runs, release_lease
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.fleet_pins import CopyGrant, FleetPin, combine, copy_grant, pin_runs
from kvstore.client.fleet_put import RunPut, _not_replicated
from kvstore.client.fleet_refresh import Refresher
from kvstore.client.retry import Retry
from kvstore.clock import Clock, SystemClock
from kvstore.config import StoreSettings
from kvstore.config_sections import FleetSettings
from kvstore.errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVStoreError,
    Unavailable,
)
from kvstore.fleet.endpoints import parse_endpoints
from kvstore.fleet.placement import RunPlacement, place_chain, placeable, replicas
from kvstore.prefix import HASH_BYTES, BlockScope
from kvstore.prefix_hosts import PrefixHost, fleet_hosts
from kvstore.v1 import kvstore_pb2 as pb
from tiers.accounting import TierStats
from tiers.block_txn import PutBatch, PutResult
from tiers.leases import Lease
from tiers.namespaces import NamespaceUsage
from tiers.reads import ReadStatus

log = logging.getLogger("kvstore.gateway")
T = TypeVar("T")

#: Callers whose node connections are kept (least recently used dropped first: soft state).
MAX_ROUTES = 64
#: Threads for routed calls (each waits on nodes, not on a core).
ROUTE_THREADS = 32


class FleetStore:
    """The fleet's router as a gateway's store (see the module's docstring).

    Args:
        settings: the gateway's store settings (limits it answers with; `block_tokens` must be the fleet's).
        fleet: `[fleet]`: etcd's endpoints, the cluster, the replication of Puts.
        tls: how to reach the nodes (None: plaintext).
        clock: the time source.

    Raises:
        Unavailable: etcd does not answer, or no node of the cluster has ever joined.
        ConfigError: `block_tokens` differs from the fleet's recorded layout.
    """

    def __init__(self, settings: StoreSettings, fleet: FleetSettings, *, tls: TlsOptions | None = None,
                 clock: Clock | None = None, timeout_s: float = 120.0) -> None:
        from kvstore.client.fleet_view import FleetView  # loads aetcd

        self.settings, self.clock = settings, clock or SystemClock()
        self.address = FleetAddress(endpoints=parse_endpoints(fleet.etcd), cluster=fleet.cluster, tls=fleet.etcd_tls,
                                    auth=fleet.etcd_auth)
        self.view = FleetView(self.address)
        if self.view.layout.block_tokens != settings.block_tokens:
            self.view.close()
            raise ConfigError(f"store.block_tokens is {settings.block_tokens}, but fleet {fleet.cluster!r} places "
                              f"{self.view.layout.block_tokens}-token blocks: give the gateway the nodes' setting")
        self.run_blocks: int = self.view.layout.run_blocks
        self.replication, self.read_ahead = fleet.replication, fleet.read_ahead
        try:  # each tenant's own replication, when its policy sets one, is its Puts' (F51)
            self.view.follow_policy(None)
        except BaseException:
            self.view.close()
            raise
        self.retry = Retry()
        self._tls, self._timeout_s = tls, timeout_s
        self._routes: OrderedDict[Route, tuple[NodePool, Refresher]] = OrderedDict()
        #: Each caller's guesses of where its prompts' stored prefixes end (F81), as long as its route is held.
        self._found: dict[Route, FoundChains] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(ROUTE_THREADS, thread_name_prefix="gateway-route")
        self._copies = ThreadPoolExecutor(ROUTE_THREADS, thread_name_prefix="gateway-copy")
        #: Gets' next runs, read while the run before is answered (F69); never behind a Put's copies.
        self._reads = ThreadPoolExecutor(ROUTE_THREADS, thread_name_prefix="gateway-read")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking routed work on the gateway's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    def close(self) -> None:
        """Send queued refreshes, close every node connection and the view."""
        with self._lock:
            routes, self._routes = list(self._routes.values()), OrderedDict()
        for pool, refresher in routes:
            refresher.close()
            pool.close()
        self._executor.shutdown(wait=True)
        self._copies.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        self.view.close()

    # -- routing -------------------------------------------------------------

    def routes_held(self) -> int:
        """Callers whose node connections are held (a metric: `gateway.metrics_gateway`)."""
        with self._lock:
            return len(self._routes)

    def _route(self, route: Route) -> tuple[NodePool, Refresher]:
        """The node connections of one caller (its token, namespace, geometry): made on first use."""
        with self._lock:
            found = self._routes.get(route)
            if found is not None:
                self._routes.move_to_end(route)
                return found
            pool = NodePool(self.view, namespace=route.namespace, geometry=route.geometry,
                            timeout_s=self._timeout_s, token=route.token, tls=self._tls)
            found = self._routes[route] = (pool, Refresher(pool))
            old = None
            if len(self._routes) > MAX_ROUTES:
                gone, old = self._routes.popitem(last=False)
                self._found.pop(gone, None)
        if old is not None:
            old[1].close()
            old[0].close()
        return found

    def copies(self, tenant: str) -> int:
        """Copies of each of `tenant`'s runs: its policy's own replication (F51), else [fleet] replication."""
        return self.view.replication_of(tenant) or self.replication

    def _replicas(self, run_key: bytes, tenant: str) -> tuple[str, ...]:
        nodes = placeable(self.view.nodes)  # as the fleet client places (one id per address)
        return replicas(run_key, nodes, max(1, min(self.copies(tenant), len(nodes))))

    def route_lookup(self, route: Route, hashes: Sequence[bytes], lease_ms: int) -> tuple[int, str | None]:
        """(found blocks, composite lease id or None) of fleet hashes from block 0 (F31, F32)."""
        pool, refresher = self._route(route)
        nodes = placeable(self.view.nodes)
        runs = place_chain(hashes, nodes, run_blocks=self.run_blocks,
                           replication=max(1, min(self.copies(route.namespace), len(nodes))))
        with self._lock:
            chains = self._found.setdefault(route, FoundChains()) if route in self._routes else FoundChains()
        guess = chains.guess(hashes)
        found = lookup_runs(pool, runs, hashes, lease_ms=lease_ms, retry=self.retry, refresher=refresher, guess=guess)
        chains.found(hashes, found.found_blocks, guess)  # the caller's next Lookup guesses from here (F81)
        return found.found_blocks, found.lease_id

    def _placed(self, hashes: Sequence[bytes], tenant: str) -> tuple[RunPlacement, ...]:
        nodes = placeable(self.view.nodes)
        return place_chain(hashes, nodes, run_blocks=self.run_blocks,
                           replication=max(1, min(self.copies(tenant), len(nodes))))

    def route_pin(self, route: Route, hashes: Sequence[bytes], found_blocks: int, until_s: float) -> FleetPin:
        """Pin the found prefix of fleet hashes `hashes` on every live copy of each run (R28)."""
        return pin_runs(self._route(route)[0], self._placed(hashes, route.namespace), hashes, found_blocks, until_s)

    def route_hosts(self, hashes: Sequence[bytes], found_blocks: int, tenant: str = "") -> tuple[PrefixHost, ...]:
        """The nodes holding the found prefix: each live replica of each run (`kvstore.prefix_hosts`), at
        `tenant`'s replication (F51; "": [fleet] replication)."""
        return fleet_hosts(self._placed(hashes, tenant), found_blocks, self.view.nodes)

    def route_stats(self, route: Route, request: pb.StatsRequest) -> pb.StatsResponse:
        """The fleet's Stats (F53): the caller's request to every live node at once, with its token (each node
        answers what the token may see), the answers merged (`gateway.fleet_stats`). A node that does not
        answer is left out, as `kvstore stats` over a fleet leaves it out of the total, and logged.

        Raises:
            KVStoreError: no node answered (the last error), or a node refused the request itself.
        """
        pool, _ = self._route(route)
        nodes = sorted(self.view.nodes)

        def ask(node: str) -> pb.StatsResponse:
            c = pool.connection(node)
            return c.call(c.kvstore.Stats, request)  # type: ignore[no-any-return]

        futures = [(node, self._copies.submit(ask, node)) for node in nodes]
        replies, last = [], None
        for node, future in futures:
            try:
                replies.append(future.result())
            except (Unavailable, DeadlineExceeded) as exc:
                log.warning("gateway: node %s left out of the fleet's Stats: %s", node, exc.message)
                last = exc
        if not replies:
            raise last or Unavailable(f"no node of fleet {self.address.cluster!r} is live")
        return merge_stats(replies)

    def route_swa(self, route: Route, request: pb.LookupRequest, found_tokens: int) -> pb.LookupResponse:
        """A Lookup's SWA candidates (F45 through a gateway, F52): asked of a node of the fleet's shared pool
        alone, against the `found_tokens` the blocks' runs gave (`swa_found_tokens`), the next pool node on
        UNAVAILABLE or DEADLINE_EXCEEDED; its answer's swa fields are the gateway's.

        Raises:
            FailedPrecondition: the nodes share no pool (`pool_nodes` names why).
            KVStoreError: no node of the pool answered (the last error), or one refused the request.
        """
        from kvstore.client.fleet_swa import pool_nodes

        pool, _ = self._route(route)
        ask = pb.LookupRequest(geometry=route.geometry, namespace=route.namespace, swa_keys=request.swa_keys,
                               swa_positions=request.swa_positions, swa_resume_limit=request.swa_resume_limit,
                               swa_found_tokens=found_tokens)
        last: KVStoreError = Unavailable(f"no node of fleet {self.address.cluster!r} serves its SWA pool")
        for node in pool_nodes(list(self.view.nodes.values())):
            try:
                c = pool.connection(node)
                return c.call(c.kvstore.Lookup, ask)  # type: ignore[no-any-return]
            except (Unavailable, DeadlineExceeded) as exc:
                pool.failed(node)
                last = exc
        raise last

    def route_release(self, route: Route, lease_id: str) -> bool:
        """Release a composite lease on every node it names (NOT_FOUND: not one)."""
        return release_lease(self._route(route)[0], lease_id)

    def route_put(self, route: Route, parts: Sequence[RunPart],
                  keep_until_s: float = 0.0) -> tuple[int, int, FleetPin | None]:
        """Each run part to all its replicas at once, part after part (F30); (written, existing) blocks, and
        with `keep_until_s` the pin every copy granted its part's last block in its own Put (R28).

        Raises:
            PutNotReplicated: a copy failed; the parts before it are on all their replicas.
        """
        pool, _ = self._route(route)
        written = existing = done = 0
        total = sum(len(p.blocks) for p in parts)
        grants: list[CopyGrant] = []
        for index, part in enumerate(parts):
            request = pb.PutRequest(geometry=route.geometry, namespace=route.namespace, parent_hash=part.parent,
                                    token_ids=part.token_ids, extra_keys=part.extra_keys, blocks=part.blocks,
                                    keep_until_s=keep_until_s)

            def copy(node: str, request: pb.PutRequest = request) -> pb.PutResponse:
                return self.retry.call(lambda: _put_on(pool, node, request))

            nodes = self._replicas(part.run_key, route.namespace)
            futures = {node: self._copies.submit(copy, node) for node in nodes}
            failures: list[tuple[int, str, KVStoreError]] = []
            most = 0
            for node, future in futures.items():
                try:
                    reply = future.result()
                except KVStoreError as exc:
                    pool.failed(node)
                    failures.append((0, node, exc))
                    continue
                if list(reply.block_hashes) != part.hashes:
                    raise Internal(f"node {node} stored a run under other hashes than the gateway computed: "
                                   "nodes and gateways of a fleet must share block_tokens and geometry")
                most = max(most, reply.written_blocks)
                if keep_until_s:
                    grants.append(copy_grant(node, index, len(part.blocks), reply))
            if failures:
                placement = RunPlacement(run=0, first_block=done, end_block=done + len(part.blocks), replicas=nodes)
                raise _not_replicated(failures, RunPut(placement=placement, first_block=done,
                                                       end_block=done + len(part.blocks)), stored=done, total=total)
            written, existing, done = written + most, existing + len(part.blocks) - most, done + len(part.blocks)
        return written, existing, combine(keep_until_s, grants) if keep_until_s else None

    def route_parent_run(self, route: Route, first_block: int, parent_hash: bytes, parent_run_key: bytes,
                         after: StoredTail | None = None) -> None:
        """R6 across runs at a gateway (F69): a Put from the first block of run r > 0 is stored only when run r - 1
        is complete on some live replica. `parent_hash` (block `first_block - 1`, run r - 1's last) is asked of
        the replicas `parent_run_key` places, in read order with failover (F33): a node holds a block only with
        every block before it in its run (R6 on the node), so one that holds it holds the whole run. Not asked when
        the request extends `after` (F69b): the request before it in the same stream, acknowledged on every replica
        of run r - 1 (F30), ended with that block in that run.

        Raises:
            InvalidArgument: `parent_run_key` is not a 32-byte hash.
            FailedPrecondition: no live replica holds the run before (nothing was stored).
            Unavailable: no replica answered after the retry policy's rounds.
        """
        if not first_block or first_block % self.run_blocks:
            return  # block 0 has no parent; inside a run the node checks the parent itself (R6)
        before = first_block // self.run_blocks - 1
        if len(parent_run_key) != HASH_BYTES:
            raise InvalidArgument(
                f"a Put from block {first_block}, the first of run {before + 1}, needs parent_run_key: the fleet "
                f"hash of block {first_block - self.run_blocks}, the first of run {before}, {HASH_BYTES} bytes "
                f"(got {len(parent_run_key)}; kvstore.Client sends it)")
        if after is not None and after.stored_before(route, first_block, parent_hash, parent_run_key):
            return  # F69b: this stream's request before stored run r - 1 to its end, on every replica
        pool, _ = self._route(route)
        run = RunPlacement(run=before, first_block=0, end_block=1,
                           replicas=self._replicas(parent_run_key, route.namespace))
        [(_, status, _)] = stream_run_part(pool, run, parent_run_key, [parent_hash], retry=self.retry,
                                           refresher=None)
        if status != pb.BLOCK_STATUS_FOUND:
            raise FailedPrecondition(
                f"parent block {parent_hash.hex()[:16]}... (block {first_block - 1}, the last of run {before}) is not "
                f"stored on any live replica of its run; put the prefix first (nothing was stored)")

    def route_get_feeds(self, route: Route, hashes: Sequence[bytes], first_block: int,
                        run_key: bytes) -> Generator[Feed[tuple[int, int, bytes]], None, None]:
        """(index, status, data) per block of `hashes` (blocks from `first_block`), one feed per run in order, each
        filled on the read threads as its node answers (F69a): run by run with failover (F33), the next run's read
        started as this run's feed is handed out (F69: one run ahead; with `[fleet] read_ahead` off, or one run, a
        single feed reads them one after another). A feed holds at most one run's blocks, so a Get holds at most
        two runs' blocks here, whatever the client's pace; closing the generator closes the feeds it made.

        Raises:
            InvalidArgument: the Get starts inside a run and `run_key` is not that run's 32-byte key.
        """
        pool, refresher = self._route(route)
        parts = list(self._get_parts(route, hashes, first_block, run_key))
        if len(parts) == 1 or not self.read_ahead:  # one run, or [fleet] read_ahead off: one run after another
            feed: Feed[tuple[int, int, bytes]] = Feed(self.run_blocks)
            produce(self._reads, feed, lambda: (b for part in parts for b in self._read_part(pool, refresher, part)))
            try:
                yield feed
            finally:
                feed.close()
            return
        ahead = self._feed(pool, refresher, parts[0])
        current = ahead
        try:
            for i in range(len(parts)):
                current = ahead
                if i + 1 < len(parts):  # the next run's read goes out before this one's blocks are answered
                    ahead = self._feed(pool, refresher, parts[i + 1])
                yield current
        finally:
            current.close()  # a Get that ended early (an error, a cancelled call) reads no further run
            ahead.close()

    def _feed(self, pool: NodePool, refresher: Refresher, part: GetPart) -> Feed[tuple[int, int, bytes]]:
        """`part`'s blocks read on the read threads into a feed holding at most the run's blocks."""
        feed: Feed[tuple[int, int, bytes]] = Feed(len(part.hashes))
        produce(self._reads, feed, lambda: self._read_part(pool, refresher, part))
        return feed

    def _get_parts(self, route: Route, hashes: Sequence[bytes], first_block: int,
                   run_key: bytes) -> Iterator[GetPart]:
        """The Get's blocks cut at run boundaries, each part placed by its run's first hash."""
        i = 0
        while i < len(hashes):
            pos = first_block + i
            n = min(self.run_blocks - pos % self.run_blocks, len(hashes) - i)
            if pos % self.run_blocks == 0:
                key = hashes[i]
            elif len(run_key) == HASH_BYTES:
                key = run_key
            else:
                raise InvalidArgument(f"a Get from block {first_block}, inside a run of {self.run_blocks} blocks, "
                                      "needs run_key: the run's first fleet hash (kvstore.Client sends it)")
            run = RunPlacement(run=pos // self.run_blocks, first_block=0, end_block=n,
                               replicas=self._replicas(key, route.namespace))
            yield GetPart(offset=i, run=run, key=key, hashes=hashes[i:i + n], run_offset=pos % self.run_blocks)
            i += n

    def _read_part(self, pool: NodePool, refresher: Refresher, part: GetPart) -> Iterator[tuple[int, int, bytes]]:
        # The copies not read are refreshed: by the hashes from the run's first block where the part starts
        # there (F34), else at the deepest block read, anchored at its depth in the run (F68a).
        for index, status, data in stream_run_part(pool, part.run, part.key, part.hashes, retry=self.retry,
                                                   refresher=refresher, run_offset=part.run_offset):
            yield part.offset + index, status, data

    # -- what a gateway does not serve (tiers.store.BlockStore by storage key) --------------------

    def _elsewhere(self, what: str) -> NoReturn:
        raise FailedPrecondition(f"{what} is not served by a gateway (it holds no blocks)",
                                 hint=f"ask a node of fleet etcd://{self.address} directly "
                                      "(kvstore fleet status lists them)")

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], lease_s: float = 0.0, *,
               touch_due: list[bytes] | None = None) -> tuple[int, Lease | None]:
        """Not by storage key: the servicer routes Lookups (`route_lookup`)."""
        self._elsewhere("a Lookup by storage key")

    def release(self, lease_id: str, *, owns: Callable[[bytes], bool] | None = None) -> bool:
        """Not here: `route_release`."""
        self._elsewhere("a Release by storage key")

    def put_many(self, batches: Sequence[PutBatch]) -> list[PutResult]:
        """Not here: `route_put`."""
        self._elsewhere("a Put by storage key")

    def read(self, keys: Sequence[bytes], copy: Callable[[int, memoryview], Any] | None = None
             ) -> list[tuple[ReadStatus, Any]]:
        """Not by storage key (ReportCorrupt is a same-host reader's call: a node's)."""
        self._elsewhere("ReportCorrupt (a read by storage key)")

    def touch_soon(self, keys: Sequence[bytes]) -> Future[None]:
        """Nothing to refresh here: the nodes refresh what they serve (F34)."""
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def count_get(self, asked_blocks: int, returned_blocks: int) -> None:
        """The nodes count Gets; the gateway's hit counters count them per tenant."""

    def stats(self) -> TierStats:
        """Not here: each node's Stats."""
        self._elsewhere("store-wide Stats")

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        """Not here: each node's Stats."""
        self._elsewhere("Stats (a tenant's usage)")


@dataclass(frozen=True, kw_only=True)
class GetPart:
    """The part of a gateway's Get that lies in one run."""

    #: Index in the Get of its first block.
    offset: int
    run: RunPlacement
    #: The run's first fleet hash: where it is placed and its read order's key.
    key: bytes
    hashes: Sequence[bytes]
    #: Index in its run of the part's first block (0: it starts at the run's first block, F34; else F68a).
    run_offset: int


def _put_on(pool: NodePool, node: str, request: pb.PutRequest) -> pb.PutResponse:
    connection = pool.connection(node)
    return connection.call(connection.kvstore.Put, request)
