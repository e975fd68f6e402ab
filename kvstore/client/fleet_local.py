"""This host's nodes of a fleet, and a fleet session's region mapped into one of them (F62).

A fleet client's shared-memory path goes to the nodes on the worker's host: a node is on this host
when its record's kernel boot id is this process's (`kvstore.prefix_hosts.host_id`; two processes
with one boot id run on one machine), or, for a record without one, when its host name is this
machine's (the rule the read order already uses, F33). A `ColocatedReader` names its node outright
(F48), and `restore` takes that one when given. The node itself then proves it maps the region: it
reads a nonce from the memfd, as for a single node's session (docs/TRANSFER.md), so a node whose
record says "this host" but cannot open this process's memory (another pid namespace) is passed by.

A fleet session's region is this process's memfd, with an id of the fleet session's; a node's
transfer session knows it by the id that node handed out. `mapped_alias` is that second name: a
`Region` object over the same mapping whose `region_id` is the node's and `shared` is set, so the
node's own session (`TransferSession`, its request ring and batches) serves it unchanged. The alias
never closes the mapping (it holds no descriptor); the fleet session closes the region itself.

`LocalMaps` holds a fleet session's mappings: one shared-memory session per node of this host, each
region's alias there, and the node's incarnation each was mapped under, so a node that restarts has
the regions mapped into it again (F72).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from kvstore.client.fleet_remote import close_node_session, incarnation
from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_ring import open_ring
from kvstore.errors import FailedPrecondition, KVStoreError, NotFound, Unavailable
from kvstore.prefix_hosts import host_id, host_name
from kvstore.region import NONCE_BYTES, Region
from kvstore.v1 import transfer_pb2 as pb


class _Record(Protocol):
    """What a node registers of its host (`kvstore.fleet.membership.NodeRecord`)."""

    @property
    def host(self) -> str: ...

    @property
    def host_id(self) -> str: ...


def on_this_host(record: _Record) -> bool:
    """Whether a node's record names this machine: its boot id where it has one, else its host name."""
    if record.host_id and host_id():
        return record.host_id == host_id()
    return bool(record.host) and record.host == host_name()


def local_nodes(nodes: Mapping[str, _Record], only: Iterable[str] | None = None) -> tuple[str, ...]:
    """The live nodes on this host (`on_this_host`), sorted; with `only`, those of them named there.

    `only` names this host's nodes outright (a `ColocatedReader`'s node, F48): they are taken when live,
    whatever their records say.
    """
    if only is not None:
        return tuple(sorted(n for n in set(only) if n in nodes))
    return tuple(sorted(n for n, r in nodes.items() if on_this_host(r)))


def map_region(session: TransferSession, region: Region) -> tuple[Region | None, str]:
    """Register `region` (fresh: its first bytes are overwritten by the nonce) with a node's shm session.

    Returns the alias the node's session knows it by, or None and why the node did not map it.

    Raises:
        KVStoreError: the node refused the call (Unavailable when it does not answer).
    """
    reply = session.ask_to_map(region)
    if not reply.shared:
        return None, reply.reason or "the node did not map the region"
    alias = copy.copy(region)
    # The alias shares the mapping and nothing else: no descriptor to close, no CUDA pinning to undo.
    alias._fd = None
    alias._pinned = None
    alias.region_id, alias.shared = reply.region_id, True
    session.regions[alias.region_id] = alias
    if session.ring is None and session._want_ring:  # as the node's own register() does at its first shared region
        session._want_ring = False
        session.ring, session.ring_reason = open_ring(session)
    return alias, ""


class LocalMaps:
    """A fleet session's regions mapped into this host's nodes (F62), and mapped again into one that restarts (F72).

    One shared-memory session per node of this host (shared by the threads), each region's alias there
    (`mapped`), and per (node, region) the node's incarnation (`fleet_remote.incarnation`: its record's address
    and start time) it was last mapped or tried under: a node whose record names another has restarted.

    Args:
        client: the fleet client (its view's records, its pool's connections and failures).
        path: the fleet session's path ("shm" refuses a region no node of this host maps; "stream" and "bulk" map
            nothing).
        streams: as `TransferSession`'s.
        only: the ids of this host's nodes, named outright (`local_nodes`' `only`).
    """

    def __init__(self, client: Any, *, path: str, streams: int | None, only: frozenset[str] | None) -> None:
        self.client = client
        self.path = path
        self.streams = streams
        self._only = only
        #: Node id -> its shared-memory session, and region id -> that region's alias there.
        self.sessions: dict[str, TransferSession] = {}
        self.mapped: dict[str, dict[int, Region]] = {}
        #: Why a node on this host maps no region of the session (node id -> reason).
        self.reasons: dict[str, str] = {}
        self._incarnations: dict[str, tuple[str, float] | None] = {}
        self._tried: dict[tuple[str, int], tuple[str, float] | None] = {}
        self._lock = threading.Lock()
        self._remapping = threading.Lock()

    def alias(self, node_id: str, region_id: int) -> Region | None:
        """The alias `node_id`'s session knows region `region_id` by, if it maps it."""
        return self.mapped.get(node_id, {}).get(region_id)

    def shared_with(self, region: Region) -> list[str]:
        """The nodes of this host that map `region`."""
        return sorted(n for n, aliases in self.mapped.items() if region.region_id in aliases)

    def map(self, region: Region) -> None:
        """Register a fresh region with each of this host's live nodes (once each, while its bytes are unused)."""
        nodes = local_nodes(self.client.view.nodes, self._only)
        for node_id in nodes:
            why = self._map_into(node_id, region)
            if why and not why.startswith("unavailable") and self.path == "shm":
                raise FailedPrecondition(f"node {node_id} of this host cannot map this process's regions: {why}",
                                         hint='use path="auto" or "stream"')
        # Refused only when no node of this host can map it: one that is down is failed over (its runs stream).
        down = any(self.reasons.get(n, "").startswith("unavailable") for n in nodes)
        if self.path == "shm" and not down and not any(region.region_id in m for m in self.mapped.values()):
            where = ", ".join(f"{n}: {self.reasons[n]}" for n in nodes if n in self.reasons)
            raise FailedPrecondition(f"no node of fleet {self.client.view.address.cluster!r} on this host maps "
                                     f"this process's regions ({where or 'none is on this host'})",
                                     hint='use path="auto" or "stream" (docs/FLEET.md F62)')

    def _map_into(self, node_id: str, region: Region) -> str:
        """Map `region` into `node_id` as the node is now (its record's incarnation); '' when mapped, else why not.

        The region's first bytes carry the nonce meanwhile and are put back after (a region mapped again holds
        blocks); a node that does not answer is noted (its runs stream) and not asked again until it restarts.
        """
        record = self.client.view.nodes.get(node_id)
        now = incarnation(record) if record is not None else None
        self.mapped.get(node_id, {}).pop(region.region_id, None)
        head = bytes(region.view[:NONCE_BYTES])
        try:
            alias, why = map_region(self._session(node_id, now), region)
        except Unavailable as exc:  # its runs stream from the other replicas, as when it dies later
            self.client.pool.failed(node_id)
            why = self.reasons[node_id] = f"unavailable: {exc.message}"
            return why
        finally:
            region.view[:len(head)] = head
            self._tried[node_id, region.region_id] = now  # after: a new session forgets what was tried
        if alias is None:
            self.reasons[node_id] = why
            return why
        self.reasons.pop(node_id, None)
        with self._lock:
            self.mapped.setdefault(node_id, {})[region.region_id] = alias
        return ""

    def remap(self, region: Region) -> None:
        """Map `region` into each of this host's nodes that is new, or has restarted, since it was last tried there
        (F72): its record names another incarnation (address, start time); the old mapping died with the old
        process. A node tried under its present incarnation is left as it is (mapped, refused or down)."""
        if self.path in ("stream", "bulk"):
            return
        nodes = self.client.view.nodes
        with self._remapping:
            for node_id in local_nodes(nodes, self._only):
                if self._tried.get((node_id, region.region_id)) != incarnation(nodes[node_id]):
                    self._map_into(node_id, region)

    def _session(self, node_id: str, now: tuple[str, float] | None = None) -> TransferSession:
        """The shared-memory session with `node_id` as it is now, opened at its first region (again when the node's
        session ended or its record names another incarnation: a restarted node knows none of the old one's)."""
        with self._lock:
            session = self.sessions.get(node_id)
            current = self._incarnations.get(node_id)
        if session is None or session.ended() or (now is not None and current != now):
            session = TransferSession(self.client.pool.connection(node_id), path="shm", streams=self.streams)
            with self._lock:
                old, self.sessions[node_id] = self.sessions.get(node_id), session
                self._incarnations[node_id] = now
                self.mapped.pop(node_id, None)  # a new session maps none of the old one's regions
                for key in [k for k in self._tried if k[0] == node_id]:
                    del self._tried[key]  # so each region is mapped into the new session when next read
            if old is not None:
                close_node_session(old)
        return session

    def unmap(self, region: Region) -> None:
        """Drop `region` from every node session (the nodes that mapped it are told, best effort)."""
        for node_id, aliases in list(self.mapped.items()):
            alias = aliases.pop(region.region_id, None)
            session = self.sessions.get(node_id)
            if alias is None or session is None:
                continue
            session.regions.pop(alias.region_id, None)
            if not session.ended():
                with contextlib.suppress(KVStoreError):  # a node gone unmaps with its session
                    session.call(session.stub.DeregisterRegion, pb.DeregisterRegionRequest(
                        session_id=session.session_id, region_id=alias.region_id))

    def failed(self, node_id: str, exc: KVStoreError) -> None:
        """A shm read of `node_id` failed: its session gone (it died or restarted), the region is no longer
        mapped there; the node is read last for a while (F33)."""
        gone = self.sessions.get(node_id)
        if isinstance(exc, NotFound) or gone is None or gone.ended():
            with self._lock:
                self.mapped.pop(node_id, None)
        self.client.pool.failed(node_id)

    def close(self) -> list[TransferSession]:
        """Forget every mapping and hand the node sessions back to be closed (`close_node_session`)."""
        with self._lock:
            sessions, self.sessions, self.mapped = list(self.sessions.values()), {}, {}
            self._tried.clear()
            self._incarnations.clear()
        return sessions


__all__ = ["LocalMaps", "local_nodes", "map_region", "on_this_host"]
