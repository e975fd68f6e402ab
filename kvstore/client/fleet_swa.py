"""The SWA pool through a fleet client: the one pool the nodes share, reached through any of them (F44, F45).

A fleet keeps its SWA snapshots in one pool every node serves (a Redis Cluster,
or one Redis: `[swa] backend`), so a snapshot put through one node is a hit
through any other, whichever node a worker's client picked. Each node records
its pool in etcd (`NodeRecord.swa_pool`, `kvstore.fleet.swa_pool`); the client
takes the nodes that record the fleet's one shared pool (`pool_nodes`) and talks
to one of them: a node on this host first, then the order drawn per client
(`NodePool.read_order`), so clients spread over the nodes. The node is the
control plane and the gateway path; with the direct path the data goes
straight between the worker and Redis, as with one server (docs/SWA_POOL.md).
When the node does not answer (UNAVAILABLE), the call is sent again through
the next one, under the fleet's retry policy: a put again stores the same
bytes, a get reads again; a delete counts only what was still there.

A snapshot's key is anchored on the fleet hash of the last full block before
it (F29's chain, `keys`), as `FleetClient.hashes` gives it: so a planner that
keys its probes from the client's hashes and a worker that keys its puts from
the tokens name the same snapshot.

A Lookup's SWA part (`resume`) is asked of that node after the blocks were
found on the runs' nodes: the node applies the resume rules to the candidates
against the found tokens the client sends (`LookupRequest.swa_found_tokens`),
since no node holds the whole prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvstore.client.connection import Connection
from kvstore.client.fleet_chain import fleet_snapshot_keys
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.retry import Retry
from kvstore.client.swa import SwaClient, SwaPutResult
from kvstore.client.swa_report import DirectReport
from kvstore.client.swa_shm import ShmPath
from kvstore.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvstore.fleet.membership import NodeRecord
from kvstore.fleet.swa_pool import is_shared
from kvstore.prefix import ExtraKey
from kvstore.v1 import kvstore_pb2 as kv_pb
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc

T = TypeVar("T")
#: The key the nodes of the pool are ordered by (per client: `NodePool.read_order` salts it).
_ORDER_KEY = b"kvstore.fleet.swa.v1"
#: How to configure a fleet's shared pool, for the errors that say it is missing.
_HINT = ('set [swa] backend = "redis-cluster" with the same cluster_nodes and key_prefix on every node '
         "(docs/FLEET.md F44)")


def pool_nodes(records: Sequence[NodeRecord]) -> list[str]:
    """The ids of the nodes that serve the fleet's SWA pool, sorted (F44).

    The pool is the one shared pool (a Redis backend) the nodes record; nodes recording another
    (their own memory, or an older node's '') are not asked. A fleet of one node serves its own pool,
    the embedded one included (the one-node default).

    Raises:
        Unavailable: no node is live.
        FailedPrecondition: two nodes record different shared pools, or several nodes and none shared.
    """
    if not records:
        raise Unavailable("no node of the fleet is live to reach the SWA pool through")
    shared: dict[str, list[str]] = {}
    for r in records:
        if is_shared(r.swa_pool):
            shared.setdefault(r.swa_pool, []).append(r.node_id)
    if len(shared) > 1:
        named = "; ".join(f"{name!r} ({', '.join(sorted(ids))})" for name, ids in sorted(shared.items()))
        raise FailedPrecondition(f"the fleet's nodes serve {len(shared)} different SWA pools: {named}; a snapshot "
                                 "put through one would not be found through another", hint=_HINT)
    if shared:
        return sorted(next(iter(shared.values())))
    if len(records) == 1:
        return [records[0].node_id]
    raise FailedPrecondition(f"each of the fleet's {len(records)} nodes keeps its own SWA pool "
                             f"({', '.join(sorted({r.swa_pool or 'unrecorded' for r in records}))}): a snapshot put "
                             "through one would not be found through another", hint=_HINT)


class FleetSwaClient(SwaClient):
    """`SwaClient` of a fleet's shared pool, through one node at a time (the module's docstring).

    Args:
        pool: the fleet client's node connections (its view, tenant and geometry).
        records: the live records to place over now (the fleet client's placeable ones).
        retry: the fleet's policy: a round asks every node of the pool once, then backs off.
        run_blocks: the fleet's run length (the keys' anchors are fleet hashes).
        path, verify, clock: as `SwaClient`'s.

    Raises:
        Unavailable: no node of the pool answers.
        FailedPrecondition: the nodes share no pool (`pool_nodes`).
    """

    def __init__(self, pool: NodePool, records: Callable[[], Sequence[NodeRecord]], *, retry: Retry,
                 run_blocks: int, path: str = "auto", verify: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool, self._records, self._retry, self.run_blocks = pool, records, retry, run_blocks
        self.node_id = ""
        node_id, connection = self._first_answering()
        super().__init__(connection, path=path, verify=verify, clock=clock)
        self.node_id = node_id

    def keys(self, tokens: Sequence[int], positions: Sequence[int], *,
             extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """Snapshot keys of `tokens` at each position, anchored on the fleet's chain (`fleet_snapshot_keys`)."""
        c = self.connection
        return fleet_snapshot_keys(tokens, positions, root=c.root, block_tokens=c.block_tokens,
                                   run_blocks=self.run_blocks, extra_keys=extra_keys)

    # -- which node --------------------------------------------------------

    def order(self) -> list[str]:
        """The pool's nodes in the order to ask them: the current one while it is in the pool, then this
        host's, then this client's draw (suspects last)."""
        ids = pool_nodes(self._records())
        drawn = [n for n in self._pool.read_order(_ORDER_KEY, ids) if n in ids]
        return sorted(drawn, key=lambda n: n != self.node_id)

    def _first_answering(self) -> tuple[str, Connection]:
        last: Unavailable | None = None
        for node_id in self.order():
            try:
                return node_id, self._pool.connection(node_id)
            except Unavailable as exc:
                last = exc
        raise last or Unavailable("no node of the fleet's SWA pool is live")

    def _bind(self, node_id: str) -> None:
        """Talk to `node_id` from now on (its connection, stub and report; a shared-memory path was the
        old node's own). A Redis direct path is kept: its user lives in the shared Redis."""
        connection = self._pool.connection(node_id)
        self.node_id, self.connection = node_id, connection
        self._stub = pb_grpc.SwaPoolStub(connection.channel)
        self._max_batch = None
        self._report = DirectReport(connection, self._stub, self.clock)  # the old node's counts are dropped
        if isinstance(self._direct, ShmPath):
            self._drop_direct(f"node {node_id} took over from the node whose shared memory it was")

    def _over_nodes(self, op: Callable[[], T]) -> T:
        """`op()` through the current node, and through the next ones of `order` while a node does not answer."""
        def round_() -> T:
            last: Unavailable | None = None
            for node_id in self.order():
                try:
                    if node_id != self.node_id:
                        self._bind(node_id)
                    return op()
                except Unavailable as exc:
                    self._pool.failed(node_id)
                    last = exc
            raise last or Unavailable("no node of the fleet's SWA pool is live")
        return self._retry.call(round_)

    @property
    def _batch(self) -> int:
        """Most snapshots per call the current node takes (asked once per node; inside a call's failover)."""
        if self._max_batch is None:
            self._max_batch = SwaClient.stats(self).max_batch_snapshots or 2**31
        return self._max_batch

    # -- calls, each failing over -----------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, int, Any]], *, ttl_s: float | None = None) -> SwaPutResult:
        """`SwaClient.put_many` through the pool's nodes (sent again through the next when one does not answer)."""
        return self._over_nodes(lambda: SwaClient.put_many(self, items, ttl_s=ttl_s))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """`SwaClient.get_many` through the pool's nodes."""
        return self._over_nodes(lambda: SwaClient.get_many(self, keys))

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """`SwaClient.delete_many` through the pool's nodes (one sent again counts only what was still there)."""
        return self._over_nodes(lambda: SwaClient.delete_many(self, keys))

    def stats(self) -> pb.SwaStatsResponse:
        """The pool's counters as the current node counts them (a shared pool's usage is the pool's)."""
        return self._over_nodes(lambda: SwaClient.stats(self))

    def resume(self, keys: Sequence[bytes], positions: Sequence[int], *, found_tokens: int,
               resume_limit: int = 0) -> tuple[int, int] | None:
        """(T, R) of the live candidate that serves the longest resume R <= `found_tokens` (and <= `resume_limit`
        when set) under the resume rules, or None (docs/SWA_POOL.md "Lookup"; the node decides, F45).

        Raises:
            InvalidArgument: not one position per key.
        """
        if len(keys) != len(positions):
            raise InvalidArgument(f"swa_keys has {len(keys)} entries but swa_positions has {len(positions)}: "
                                  "send one position per key")
        if not keys or found_tokens <= 0:  # a resume needs found blocks (resume rule 5)
            return None

        def ask() -> kv_pb.LookupResponse:
            c = self.connection
            request = kv_pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, swa_keys=list(keys),
                                          swa_positions=list(positions), swa_resume_limit=resume_limit,
                                          swa_found_tokens=found_tokens)
            return c.call(c.kvstore.Lookup, request)

        reply = self._over_nodes(ask)
        return (reply.swa_position, reply.swa_resume_tokens) if reply.swa_found else None


def swa_records(nodes: Mapping[str, NodeRecord], placeable: Sequence[str]) -> list[NodeRecord]:
    """The records of the `placeable` ids (one per address: F42), for `pool_nodes`."""
    return [nodes[n] for n in placeable if n in nodes]


__all__ = ["FleetSwaClient", "fleet_snapshot_keys", "pool_nodes", "swa_records"]
