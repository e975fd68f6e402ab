"""Who is in the fleet: a node's registration in etcd under a lease, and the live view of every node.

A storage node registers one key, `/kvstore/<cluster>/nodes/<node_id>`, whose
value is its `NodeRecord` (JSON), attached to a lease of `lease_ttl_s` that it
renews every third of the TTL (`Registration`). The key lives exactly as long
as the lease: a node that dies, hangs or loses its network leaves the view
within the TTL (F3); a clean stop revokes the lease, so it leaves at once (F4).
A node whose lease was lost while it lived (etcd restored from a snapshot, the
lease revoked by hand) registers again on its next renewal (F5).

`Membership` is the view clients and nodes route by: it lists the prefix once,
then follows `watch_prefix` from the listed revision, so it never misses an
event between the two (F6). When etcd cannot be reached it keeps the last set
it saw and says it is stale (F7): the data plane goes on with the nodes it last
knew, and the view relists when etcd answers again. Rules: docs/FLEET.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any

import aetcd

from kvstore.config_sections import FleetSettings
from kvstore.errors import ConfigError, DeadlineExceeded, FailedPrecondition, KVStoreError
from kvstore.fleet.endpoints import layout_key, node_key, nodes_prefix, parse_endpoints
from kvstore.fleet.etcd import EtcdSession, follow_prefix, stop_task
from kvstore.fleet.placement import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    """What a node says of itself in etcd: its id, where to reach it, what it holds."""

    #: The stable id kept in its data dir (tiers.datadir.node_id): the same across restarts, new when wiped.
    node_id: str
    #: host:port clients and other nodes reach its gRPC port at.
    address: str
    #: The machine's name (same-host paths are chosen by it).
    host: str
    #: Bytes of block data it may hold (store.capacity_bytes).
    capacity_bytes: int
    #: Unix time (seconds) its process started serving.
    started_at: float
    #: kvstore's version on it.
    version: str
    #: The SWA pool it serves (`kvstore.fleet.swa_pool.pool_name`; '' from a node older than F44).
    swa_pool: str = ""
    #: The machine's kernel boot id (`kvstore.prefix_hosts.host_id`): a worker with the same runs beside it.
    host_id: str = ""
    #: Its store's data dir, for a same-host reader (ColocatedReader); '' from a node older than the hosts answer.
    data_dir: str = ""
    #: Whether it drains (`kvstore fleet drain`, docs/FLEET.md F21): still a member and serving, but placed on by
    #: no one (no new Puts, no replica's place in any repair pass); reads ask it after the others.
    draining: bool = False

    def to_json(self) -> bytes:
        """The record as etcd stores it."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeRecord:
        """Parse a stored record.

        Raises:
            ValueError: not a JSON object with every field, of the right types.
        """
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        try:
            record = cls(node_id=str(raw["node_id"]), address=str(raw["address"]), host=str(raw["host"]),
                         capacity_bytes=int(raw["capacity_bytes"]), started_at=float(raw["started_at"]),
                         version=str(raw["version"]), swa_pool=str(raw.get("swa_pool", "")),
                         host_id=str(raw.get("host_id", "")), data_dir=str(raw.get("data_dir", "")),
                         draining=bool(raw.get("draining", False)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"missing or mistyped field {exc}") from None
        return record


@dataclass(frozen=True, kw_only=True)
class RegisteredNode:
    """A node record as found in etcd, with the lease that keeps it there."""

    record: NodeRecord
    lease_id: int


def _parse(key: bytes, value: bytes, prefix: bytes) -> NodeRecord | None:
    """The record under `key`, or None (logged) when it does not parse or names another id than its key."""
    try:
        record = NodeRecord.from_json(value)
    except ValueError as exc:
        log.warning("fleet: ignoring the damaged node record %s: %s", key.decode(errors="replace"), exc)
        return None
    if prefix + record.node_id.encode() != key:
        log.warning("fleet: ignoring the node record %s: it names node %s", key.decode(errors="replace"),
                    record.node_id)
        return None
    return record


async def read_nodes(session: EtcdSession, cluster: str) -> tuple[list[RegisteredNode], int]:
    """Every parsable node record of `cluster`, in key order, and the etcd revision it was read at.

    Raises:
        Unavailable: etcd does not answer at any endpoint.
    """
    prefix = nodes_prefix(cluster)
    found = await session.call(lambda c: c.get_prefix(prefix))
    nodes = []
    for kv in found:
        record = _parse(kv.key, kv.value, prefix)
        if record is not None:
            nodes.append(RegisteredNode(record=record, lease_id=kv.lease))
    return nodes, found.header.revision


async def lease_ttl_s(session: EtcdSession, lease_id: int) -> int:
    """Seconds left on a lease (-1: it is gone)."""
    info = await session.call(lambda c: c.get_lease_info(lease_id, keys=False))
    return int(info.TTL)


class Registration:
    """One node's record in etcd, kept alive under a lease while the node serves.

    Args:
        session: the etcd session (the registration closes it when it stops).
        cluster: the fleet's name.
        record: what the node says of itself.
        ttl_s: the lease's TTL; the lease is renewed every third of it.
        layout: the placement layout this node was configured with; the first node
            of a cluster records it, and a node with another is refused (F8).
    """

    def __init__(self, session: EtcdSession, cluster: str, record: NodeRecord, *, ttl_s: int,
                 layout: Layout | None = None) -> None:
        self.session = session
        self.cluster = cluster
        self.record = record
        self.ttl_s = ttl_s
        self.layout = layout
        self.key = node_key(cluster, record.node_id)
        #: The lease holding the key now (None before start and after stop).
        self.lease_id: int | None = None
        #: How many times the key was written: 1 after start, one more per registration after a lost lease.
        self.registrations = 0
        #: Keep-alives etcd answered with the lease still alive, and those that could not reach etcd
        #: (read by the node's metrics, gateway/metrics_fleet.py).
        self.renewals = 0
        self.renewal_failures = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register (check the layout, claim the key under a new lease) and keep the lease alive.

        Raises:
            Unavailable: etcd does not answer at any endpoint.
            ConfigError: the cluster's recorded layout differs from this node's.
            FailedPrecondition: another live node holds this node id (a copied data dir).
        """
        try:
            if self.layout is not None:
                await self._check_layout(self.layout)
            await self._register()
        except BaseException:
            await self.session.close()
            raise
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="fleet-registration")

    async def _check_layout(self, layout: Layout) -> None:
        key = layout_key(self.cluster)
        ours = layout.to_json()

        async def record_or_read(c: aetcd.Client) -> tuple[bool, list[Any]]:
            tx = c.transactions
            return await c.transaction(compare=[tx.version(key) == 0], success=[tx.put(key, ours)],
                                       failure=[tx.get(key)])

        created, responses = await self.session.call(record_or_read)
        if created:
            return
        theirs = responses[0][0][0] if responses and responses[0] else b"{}"
        if Layout.from_json(theirs) != layout:
            raise ConfigError(f"fleet {self.cluster!r} places blocks with {theirs.decode(errors='replace')} "
                              f"(recorded in etcd at {key.decode()}), but this node is configured with "
                              f"{ours.decode()}: nodes and clients must place alike",
                              hint="set fleet.run_blocks and store.block_tokens as the fleet's other nodes have them")

    async def _register(self) -> None:
        """Grant a lease and write the record under it: create the key, or take over our own previous one."""
        lease = await self.session.call(lambda c: c.lease(self.ttl_s))
        value = self.record.to_json()
        key = self.key

        async def claim(c: aetcd.Client) -> tuple[bool, list[Any]]:
            tx = c.transactions
            return await c.transaction(compare=[tx.version(key) == 0], success=[tx.put(key, value, lease=lease.id)],
                                       failure=[tx.get(key)])

        try:
            claimed, responses = await self.session.call(claim)
            if not claimed:
                await self._take_over(responses, lease.id)
        except BaseException:
            with contextlib.suppress(KVStoreError):
                await self.session.call(lambda c: c.revoke_lease(lease.id))
            raise
        self.lease_id = lease.id
        self.registrations += 1
        log.info("fleet: node %s registered in %r at %s (lease %x, %d s)", self.record.node_id, self.cluster,
                 self.record.address, lease.id, self.ttl_s)

    async def _take_over(self, responses: list[Any], lease_id: int) -> None:
        """The key exists: rewrite it under our lease if it is this node's earlier registration (F2).

        The same machine (or the same address) means this data dir's earlier process, killed
        before its lease ended: the data dir's lock admits one server at a time. Another
        machine at another address is a second node claiming our id: a copied data dir.
        """
        found = responses[0][0][1] if responses and responses[0] else None
        if found is None:  # deleted between the two reads: claim it on the next try
            raise FailedPrecondition(f"fleet: the record of node {self.record.node_id} changed while registering",
                                     hint="retry")
        theirs = _parse(found.key, found.value, nodes_prefix(self.cluster))
        ours = self.record
        if theirs is not None and theirs.address != ours.address and theirs.host != ours.host:
            ttl = await lease_ttl_s(self.session, found.lease)
            raise FailedPrecondition(
                f"fleet: node id {self.record.node_id} is registered by {theirs.address} on {theirs.host} "
                f"(its lease ends in {ttl} s unless renewed): two nodes share one data dir's identity",
                hint="a copied data dir is one node's data twice: give this node an empty store.data_dir, "
                     "or stop the other node and wait for its lease to end")
        key, value, mod = self.key, ours.to_json(), found.mod_revision

        async def replace(c: aetcd.Client) -> tuple[bool, list[Any]]:
            tx = c.transactions
            return await c.transaction(compare=[tx.mod(key) == mod], success=[tx.put(key, value, lease=lease_id)],
                                       failure=[])

        replaced, _ = await self.session.call(replace)
        if not replaced:
            raise FailedPrecondition(f"fleet: the record of node {self.record.node_id} changed while registering",
                                     hint="retry")

    async def set_draining(self, draining: bool, session: EtcdSession | None = None) -> None:
        """Say in the record whether this node drains (F21), rewritten under the lease it holds (through
        `session`, default the registration's own); a registration after a lost lease writes it too.

        Raises:
            Unavailable: etcd does not answer (the record in etcd is unchanged; the next call tries again).
        """
        self.record = replace(self.record, draining=draining)
        lease_id, key, value = self.lease_id, self.key, self.record.to_json()
        if lease_id is not None:
            await (session or self.session).call(lambda c: c.put(key, value, lease=lease_id))

    async def _keep_alive(self) -> None:
        """Renew the lease every third of its TTL; register again when it was lost (F5)."""
        period_s = self.ttl_s / 3
        while True:
            await asyncio.sleep(period_s)  # the renewal period, not a wait for a condition
            lease_id = self.lease_id
            try:
                if lease_id is None:
                    await self._register()
                    continue
                reply = await self._renew(lease_id)
                if reply is None or reply.TTL <= 0:
                    log.warning("fleet: node %s lost its lease %x (expired or revoked); registering again",
                                self.record.node_id, lease_id)
                    self.lease_id = None
                    await self._register()
                else:
                    self.renewals += 1
            except KVStoreError as exc:
                self.renewal_failures += 1
                log.warning("fleet: node %s cannot renew its registration: %s; retrying in %.1f s (a lease "
                            "expires %d s after its last renewal)", self.record.node_id, exc.message, period_s,
                            self.ttl_s)
            except Exception:  # a bug must not end the renewals silently
                log.exception("fleet: renewing node %s's registration failed", self.record.node_id)

    async def _renew(self, lease_id: int) -> Any:
        """One keep-alive of the lease: etcd's reply, whose TTL is 0 when the lease is gone."""
        return await self.session.call(lambda c: c.refresh_lease(lease_id))

    async def stop(self) -> None:
        """Stop renewing and revoke the lease, which deletes the key at once (F4); close the session.

        When etcd cannot be reached the lease is left to expire on its own, within its TTL.
        """
        if self._task is not None:
            await stop_task(self._task)  # again while a cancel is lost (aetcd)
            self._task = None
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is not None:
            try:
                await self.session.call(lambda c: c.revoke_lease(lease_id))
                log.info("fleet: node %s deregistered", self.record.node_id)
            except KVStoreError as exc:
                log.warning("fleet: node %s could not deregister (%s); its record expires within %d s",
                            self.record.node_id, exc.message, self.ttl_s)
        await self.session.close()


class Membership:
    """The live nodes of a cluster, kept current from etcd's watch; the last set seen while etcd is away.

    Args:
        session: the etcd session (the view closes it when it closes).
        cluster: the fleet's name.
        retry_s: seconds between attempts to reach etcd again while it is away.
    """

    def __init__(self, session: EtcdSession, cluster: str, *, retry_s: float = 1.0) -> None:
        self.session = session
        self.cluster = cluster
        self.retry_s = retry_s
        self._prefix = nodes_prefix(cluster)
        self._nodes: Mapping[str, NodeRecord] = MappingProxyType({})
        self._stale_since: float | None = None
        self._revision = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    @property
    def nodes(self) -> Mapping[str, NodeRecord]:
        """node id -> record of every live node, as last seen (an immutable snapshot: replaced on change)."""
        return self._nodes

    @property
    def node_ids(self) -> frozenset[str]:
        """The live nodes' ids, what placement hashes over."""
        return frozenset(self._nodes)

    @property
    def stale(self) -> bool:
        """Whether etcd is out of reach, so the view is the last set seen, not necessarily today's (F7)."""
        return self._stale_since is not None

    @property
    def stale_s(self) -> float:
        """Seconds since the view lost etcd (0 while it is current)."""
        return 0.0 if self._stale_since is None else time.monotonic() - self._stale_since

    @property
    def revision(self) -> int:
        """The etcd revision the view reflects."""
        return self._revision

    async def start(self) -> None:
        """Read the nodes, then follow the watch in the background.

        Raises:
            Unavailable: etcd does not answer at any endpoint (nothing was started).
        """
        revision = await self._relist()
        self._task = asyncio.get_running_loop().create_task(self._follow(revision), name="fleet-membership")

    async def _relist(self) -> int:
        nodes, revision = await read_nodes(self.session, self.cluster)
        await self._publish({n.record.node_id: n.record for n in nodes}, revision, stale=False)
        return revision

    async def _publish(self, nodes: Mapping[str, NodeRecord], revision: int, *, stale: bool) -> None:
        self._nodes = MappingProxyType(dict(nodes))
        self._revision = revision
        if not stale:
            self._stale_since = None
        elif self._stale_since is None:
            self._stale_since = time.monotonic()
        async with self._changed:
            self._changed.notify_all()

    async def _follow(self, revision: int) -> None:
        """Apply watch events from `revision + 1`; on any failure mark the view stale, relist and watch again."""
        await follow_prefix(self.session, self._prefix, revision, apply=self._apply, lost=self._lost,
                            reload=self._relisted, retry_s=self.retry_s)

    async def _lost(self, exc: Exception) -> None:
        if not self.stale:
            log.warning("fleet: lost etcd's watch of %s (%s); keeping the %d nodes last seen",
                        self._prefix.decode(), exc, len(self._nodes))
        await self._publish(self._nodes, self._revision, stale=True)

    async def _relisted(self) -> int:
        revision = await self._relist()
        log.warning("fleet: etcd answers again; the view of %s is current (%d nodes)",
                    self._prefix.decode(), len(self._nodes))
        return revision

    async def _apply(self, event: aetcd.Event) -> None:
        revision = event.kv.mod_revision
        nodes = dict(self._nodes)
        node_id = event.kv.key[len(self._prefix):].decode(errors="replace")
        record = _parse(event.kv.key, event.kv.value, self._prefix) if event.kind == aetcd.EventKind.PUT else None
        if record is None:
            nodes.pop(node_id, None)
        else:
            nodes[node_id] = record
        await self._publish(nodes, revision, stale=False)

    async def wait_until(self, predicate: Callable[[Membership], bool], timeout_s: float) -> None:
        """Return once `predicate(self)` holds (checked now and after every change of the view).

        Raises:
            DeadlineExceeded: it did not hold within `timeout_s`.
        """
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(f"the fleet view did not reach the awaited state within {timeout_s:g} s "
                                       f"({len(self._nodes)} nodes, stale={self.stale})") from None

    async def close(self) -> None:
        """Stop following and close the session."""
        if self._task is not None:
            await stop_task(self._task)  # again while a cancel is lost (aetcd)
            self._task = None
        await self.session.close()


def session_for(fleet: FleetSettings, *, timeout_s: float | None = None) -> EtcdSession:
    """An etcd session to the fleet's endpoints (TLS and the etcd user as [fleet] says: F57, F70); each call's
    deadline is a third of the lease TTL by default (so a renewal that fails over to another member still lands
    before the lease ends).

    Raises:
        ConfigError: a TLS or password file that cannot be read (naming it).
    """
    return EtcdSession(parse_endpoints(fleet.etcd), timeout_s=timeout_s or fleet.lease_ttl_s / 3, tls=fleet.etcd_tls,
                       auth=fleet.etcd_auth)


def advertised_address(fleet: FleetSettings, bind_host: str, port: int) -> str:
    """Where others reach this node: fleet.advertise, else the bound host and port (this host's name
    when the server binds every address, which no other host could dial)."""
    if fleet.advertise:
        return fleet.advertise
    host = socket.getfqdn() if bind_host in ("", "0.0.0.0", "::", "[::]") else bind_host
    return f"{host}:{port}"


async def register_node(fleet: FleetSettings, *, node_id: str, address: str, capacity_bytes: int,
                        block_tokens: int, swa_pool: str = "", data_dir: str = "") -> Registration:
    """Register a serving node in its fleet and keep it registered (`Registration.stop` ends it).

    Raises:
        Unavailable: etcd does not answer at any endpoint (the node does not start: docs/FLEET.md F14).
        ConfigError: the fleet places blocks with another layout.
        FailedPrecondition: another live node holds this node id.
    """
    from kvstore.prefix_hosts import host_id
    from kvstore.version import __version__

    record = NodeRecord(node_id=node_id, address=address, host=socket.gethostname(), capacity_bytes=capacity_bytes,
                        started_at=time.time(), version=__version__, swa_pool=swa_pool, host_id=host_id(),
                        data_dir=data_dir)
    registration = Registration(session_for(fleet), fleet.cluster, record, ttl_s=fleet.lease_ttl_s,
                                layout=Layout(run_blocks=fleet.run_blocks, block_tokens=block_tokens))
    await registration.start()
    return registration
