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
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from kvstore.client.fleet_address import FleetAddress
from kvstore.errors import Unavailable
from kvstore.fleet.endpoints import layout_key
from kvstore.fleet.etcd import EtcdSession
from kvstore.fleet.membership import Membership, NodeRecord
from kvstore.fleet.placement import Layout

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
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fleet-view-{address.cluster}",
                                        daemon=True)
        self._thread.start()
        self._membership = Membership(EtcdSession(address.endpoints, timeout_s=timeout_s), address.cluster)
        try:
            #: How runs are cut (recorded in etcd by the first node: F8).
            self.layout: Layout = self._run(self._start(), timeout_s * 2)
        except Unavailable as exc:
            self.close()
            if "etcd does not answer" in exc.message:  # the node's hint names its setting; a client has an address
                exc.hint = "start etcd there, or give the fleet's etcd client endpoints in the etcd:// address"
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
            self._run(self._membership.close(), 10.0)
            self._run(_cancel_the_rest(), 10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()


async def _cancel_the_rest() -> None:
    """End what the etcd client left on the loop (a closed watch's call tasks), so none is destroyed pending."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
