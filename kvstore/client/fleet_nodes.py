"""The fleet client's connections, one per node, and the order a run's replicas are read in.

`NodePool` holds one `Connection` per live node (opened at first use, opened
again when a node comes back at another address) and remembers the nodes that
just failed a call, so that for a few seconds they are asked last (a node killed
stays in etcd's view until its lease ends: F3).

Reads go to the nearest replica (docs/FLEET.md, "Data path"): a node on this
host first, then the others in an order drawn per client and per run (a
rendezvous score salted with this client's random salt), so the readers of a
shared system prompt spread over all its replicas instead of pinning the
placement's first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore.client import fleet_metrics
from kvstore.client.connection import Connection, TlsOptions
from kvstore.errors import KVStoreError, Unavailable
from kvstore.fleet.placement import ranked, score

if TYPE_CHECKING:
    from kvstore.client.fleet_view import FleetView
    from kvstore.fleet.membership import NodeRecord

#: Seconds a node that failed a call is asked last.
SUSPECT_S = 5.0
#: Runs whose replicas' read order a pool remembers (then forgets them all and draws again).
MAX_DRAWS = 1 << 16


class NodePool:
    """One connection per node of a fleet, for one tenant and geometry.

    Args:
        view: the live nodes.
        namespace, geometry, timeout_s, token, tls: as `kvstore.Client`'s, for every node.
        clock: monotonic seconds (injected in tests).
        suspect_s: seconds a node that failed a call is read last (0: never moved back).
    """

    def __init__(self, view: FleetView, *, namespace: str, geometry: str, timeout_s: float, token: str | None,
                 tls: TlsOptions | None, clock: Callable[[], float] = time.monotonic,
                 suspect_s: float = SUSPECT_S) -> None:
        self.view = view
        self._options = {"namespace": namespace, "geometry": geometry, "timeout_s": timeout_s, "token": token,
                         "tls": tls}
        self._clock = clock
        self.suspect_s = suspect_s
        #: Failed calls per node since the pool opened.
        self.failures: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._connections: dict[str, Connection] = {}
        self._opening: dict[str, threading.Lock] = {}
        self._failed_at: dict[str, float] = {}
        #: This client's salt for spreading reads over replicas.
        self.salt = os.urandom(16)
        self.hostname = socket.gethostname()
        self._draws: dict[tuple[bytes, tuple[str, ...]], tuple[str, ...]] = {}
        #: Read orders made, with the view snapshot, the suspects and the host name they were made under.
        self._orders: dict[tuple[bytes, tuple[str, ...]],
                           tuple[Mapping[str, NodeRecord], frozenset[str], tuple[str, ...], str]] = {}
        self._nodes_seen: tuple[Mapping[str, NodeRecord], frozenset[str]] | None = None

    def connection(self, node_id: str) -> Connection:
        """The connection to `node_id` (opened now if needed).

        Raises:
            Unavailable: the node is not in the view, or does not answer.
            KVStoreError: the node refused the connection (the class of its status).
        """
        record = self.view.nodes.get(node_id)
        if record is None:
            raise Unavailable(f"node {node_id} is not in fleet {self.view.address.cluster!r} now")
        with self._lock:
            found = self._connections.get(node_id)
            if found is not None and found.target == record.address:
                return found
            opening = self._opening.setdefault(node_id, threading.Lock())
        with opening:  # one GetInfo per node at a time, not one per thread
            with self._lock:
                found = self._connections.get(node_id)
            if found is not None and found.target == record.address:
                return found
            try:
                fresh = Connection(record.address, **self._options)  # type: ignore[arg-type]
            except KVStoreError:
                self.failed(node_id)
                raise
            with self._lock:
                old, self._connections[node_id] = self._connections.get(node_id), fresh
            if old is not None:
                old.close()
            return fresh

    def failed(self, node_id: str) -> None:
        """Note that `node_id` just failed a call: it is read last for `suspect_s`."""
        with self._lock:
            self.failures[node_id] += 1
            self._failed_at[node_id] = self._clock()
        fleet_metrics.node_error(node_id)

    def suspect(self, node_id: str) -> bool:
        """Whether `node_id` failed a call within the last `suspect_s`."""
        with self._lock:
            failed_at = self._failed_at.get(node_id)
            return failed_at is not None and self._clock() - failed_at < self.suspect_s

    def read_order(self, run_key: bytes, replicas: Sequence[str]) -> list[str]:
        """The order to read a run's replicas in: this host's first, then per this client's draw; suspects last;
        then the live node ranked next after them (F42).

        The next-ranked node is a run's copy that the placement stopped naming: when a node joins while a lost
        one is still in the view (its lease runs), the two can take both places of a run whose one surviving
        copy is the old holder ranked next. It is asked only when every replica falls short.

        The draw is this client's for good (its salt is), so it is remembered per (run, replicas) and a prompt
        sent again is ordered without hashing: a Lookup of a 1M-token prompt orders its 62 runs.
        """
        nodes = self.view.nodes
        suspects = self._suspects()
        key = (run_key, tuple(replicas))
        made = self._orders.get(key)
        if made is not None and made[0] is nodes and made[1] == suspects and made[3] == self.hostname:
            return list(made[2])  # the same view and suspects: the same order (a prompt sent again, F77's rounds)
        drawn = self._drawn(*key)
        if suspects or any(self._here(nodes, n) for n in drawn):
            order = sorted(drawn, key=lambda n: (n in suspects, not self._here(nodes, n)))  # stable: the draw
        else:
            order = list(drawn)
        if replicas and len(nodes) > len(replicas):
            order += [n for n in ranked(run_key, self._node_set(nodes), len(replicas) + 1) if n not in replicas][:1]
        if len(self._orders) >= MAX_DRAWS:
            self._orders.clear()  # a bound, not a policy: an order is made again exactly
        self._orders[key] = (nodes, suspects, tuple(order), self.hostname)
        return order

    def _drawn(self, run_key: bytes, replicas: tuple[str, ...]) -> tuple[str, ...]:
        """`replicas` in this client's draw (highest salted score first; ties in the given order)."""
        key = (run_key, replicas)
        found = self._draws.get(key)
        if found is None:
            if len(self._draws) >= MAX_DRAWS:
                self._draws.clear()  # a bound, not a policy: the draw is recomputed exactly
            found = self._draws[key] = tuple(sorted(replicas, key=lambda n: -score(self.salt + run_key, n)))
        return found

    def _suspects(self) -> frozenset[str]:
        """The nodes that failed a call within the last `suspect_s`."""
        with self._lock:
            if not self._failed_at:
                return frozenset()
            now = self._clock()
            return frozenset(n for n, at in self._failed_at.items() if now - at < self.suspect_s)

    def _here(self, nodes: Mapping[str, NodeRecord], node_id: str) -> bool:
        record = nodes.get(node_id)
        return record is not None and record.host == self.hostname

    def _node_set(self, nodes: Mapping[str, NodeRecord]) -> frozenset[str]:
        """The live node ids as one frozenset per view snapshot (placement's memo is keyed by it)."""
        held = self._nodes_seen
        if held is None or held[0] is not nodes:
            held = self._nodes_seen = (nodes, frozenset(nodes))
        return held[1]

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for c in connections:
            c.close()
