"""The live node set of a fleet, for a synchronous client: `kvstore.fleet.membership.Membership` on a thread.

The membership view is asyncio (aetcd). A worker's `Client` is synchronous, so
`FleetView` runs one event loop on a daemon thread of its own, starts the view
there (list, then watch: docs/FLEET.md F6) and reads the fleet's placement
layout once. Readers on any thread see `nodes`, an immutable snapshot the loop
replaces on each change (one attribute read, atomic under the GIL), so routing
never waits on etcd. While etcd is away the view keeps the last set it saw and
says it is stale (F7): the client routes by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Coroutine, Mapping
from functools import partial
from typing import Any, TypeVar

from kvstore.client.fleet_address import FleetAddress
from kvstore.errors import Unavailable
from kvstore.fleet.endpoints import layout_key, policies_prefix, policy_key
from kvstore.fleet.etcd import EtcdSession, stop_task
from kvstore.fleet.membership import Membership, NodeRecord
from kvstore.fleet.placement import Layout
from kvstore.fleet.tables import WatchedPrefix

T = TypeVar("T")


class FleetView:
    """The nodes of one fleet, kept current from etcd on a background thread.

    Args:
        address: the fleet's etcd endpoints and cluster.
        timeout_s: deadline of each etcd call, and of the start.

    Raises:
        Unavailable: etcd does not answer, or no node of the cluster has ever joined (no layout).
    """

    def __init__(self, address: FleetAddress, *, timeout_s: float = 5.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        #: Tenants' own replication in etcd, once `follow_policy` started (F51), and whose (None: every tenant's).
        self._policy: WatchedPrefix[int | None] | None = None
        self._policy_tenant: str | None = None
        # The session first: TLS files that cannot be read fail here (ConfigError), before any thread starts.
        session = EtcdSession(address.endpoints, timeout_s=timeout_s, tls=address.tls, auth=address.auth)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fleet-view-{address.cluster}",
                                        daemon=True)
        self._thread.start()
        self._membership = Membership(session, address.cluster)
        try:
            #: How runs are cut (recorded in etcd by the first node: F8).
            self.layout: Layout = self._run(self._start(), timeout_s * 2)
        except Unavailable as exc:
            self.close()
            if "etcd does not answer" in exc.message:  # the node's hint names its setting; a client has an address
                exc.hint = ("start etcd there, or give the fleet's etcd client endpoints in the etcd:// address "
                            "(etcds://...?ca_file=PATH for an etcd serving TLS)")
            raise
        except BaseException:
            self.close()
            raise

    async def _start(self) -> Layout:
        found = await self._membership.session.call(lambda c: c.get(layout_key(self.address.cluster)))
        layout = Layout.from_json(found.value) if found is not None else None
        if layout is None:
            raise Unavailable(f"no node of fleet {self.address.cluster!r} has joined etcd at "
                              f"{','.join(str(e) for e in self.address.endpoints)} (no placement layout recorded)",
                              hint="start a node with [fleet] etcd and cluster set, or check the cluster's name")
        await self._membership.start()
        return layout

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def nodes(self) -> Mapping[str, NodeRecord]:
        """node id -> record of every live node, as last seen (an immutable snapshot)."""
        return self._membership.nodes

    def follow_policy(self, tenant: str | None) -> None:
        """Follow `tenant`'s policy in etcd (`/kvstore/<cluster>/policies/<tenant>`), or every tenant's (None: a
        gateway's), for `replication_of` (F51). An etcd away keeps the last values seen (F24).

        Raises:
            Unavailable: etcd does not answer (nothing was started).
        """
        cluster = self.address.cluster
        prefix = policies_prefix(cluster) if tenant is None else policy_key(cluster, tenant)
        session = EtcdSession(self.address.endpoints, timeout_s=self._timeout_s, tls=self.address.tls,
                              auth=self.address.auth)
        table = WatchedPrefix(session, prefix,
                              partial(_own_replication, "" if tenant is not None else None), table="policy")
        try:
            self._run(table.start(), self._timeout_s * 2)
        except BaseException:
            self._run(table.close(), 10.0)
            raise
        self._policy, self._policy_tenant = table, tenant

    def replication_of(self, tenant: str) -> int | None:
        """`tenant`'s own replication (None: it has none set, or its policy is not followed)."""
        if self._policy is None or (self._policy_tenant is not None and tenant != self._policy_tenant):
            return None
        row = self._policy.rows.get("" if self._policy_tenant is not None else tenant)
        return row.value if row is not None else None

    @property
    def stale(self) -> bool:
        """Whether etcd is away, so `nodes` is the last set seen (F7)."""
        return self._membership.stale

    def wait_until(self, predicate: Callable[[Mapping[str, NodeRecord]], bool], timeout_s: float) -> None:
        """Return once `predicate(nodes)` holds (checked now and at each change of the view).

        Raises:
            DeadlineExceeded: it did not within `timeout_s`.
        """
        self._run(self._membership.wait_until(lambda m: predicate(m.nodes), timeout_s), timeout_s + 5.0)

    def close(self) -> None:
        """Stop following etcd and end the thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):  # closing a view whose etcd is gone must not raise
            if self._policy is not None:
                self._run(self._policy.close(), 10.0)
            self._run(self._membership.close(), 10.0)
            self._run(_cancel_the_rest(), 10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()


def _own_replication(only: str | None, name: str, value: bytes) -> int | None:
    """The replication of a tenant's own policy record (None: not set, or not a record to read: `only` names
    the one wanted, "" for the exact key; a longer tenant name sharing its prefix, or the defaults' record).

    Raises:
        ValueError: the record is not a policy's JSON object, or its replication is not a whole 1-5.
    """
    if (only is not None and name != only) or name.startswith("."):
        return None
    fields = json.loads(value)
    if not isinstance(fields, dict):
        raise ValueError("a policy record is a JSON object")
    copies = fields.get("replication")
    if copies is None:
        return None
    if isinstance(copies, bool) or not isinstance(copies, int | float) or copies != int(copies) \
            or not 1 <= copies <= 5:
        raise ValueError(f"replication {copies!r} is not a whole number from 1 to 5")
    return int(copies)


async def _cancel_the_rest() -> None:
    """End what the etcd client left on the loop (a closed watch's call tasks), so none is destroyed pending; each
    cancelled again until it ends (F88: a cancel can be lost inside aetcd)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    await asyncio.gather(*(stop_task(t) for t in tasks), return_exceptions=True)
