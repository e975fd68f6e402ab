"""A fleet transfer session's sessions with the nodes it reads over the network: the stream, and the bulk transport.

A run that is not read over shared memory (F62) comes from its node either by the stream path
(`TransferSession(path="stream")`: no server session, blocks over `Transfer.Fetch`; one per node and thread,
as a stream session is not shared between threads) or, where the node runs it, by the bulk transport
(`TransferSession(path="bulk")`: the node's Mooncake engine writes the blocks into this process's region; one
per node, kept across fetches and shared by the threads one read at a time, docs/FLEET.md F74). A region is
registered with this process's engines once however many node sessions hold it
(`transfer_bulk.register_counted`, F73), so one session closing leaves it registered for the others.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.client.transfer import TransferSession
from kvstore.errors import KVStoreError
from kvstore.region import Region

#: (node id, incarnation) -> why that process of the node runs no bulk transport: a property of the process (its
#: `transfer.bulk`), so learned once per process here, not once per fleet session (a `restore` opens one per call).
_NO_BULK: dict[tuple[str, tuple[str, float] | None], str] = {}
_NO_BULK_LOCK = threading.Lock()
#: Entries kept at most (then all forgotten: each is learned again by one OpenSession).
MAX_NO_BULK = 4096


def no_bulk_reason(node_id: str, record: Any) -> str | None:
    """Why the process a node record names runs no bulk transport, if this process found so (None: not known)."""
    with _NO_BULK_LOCK:
        return _NO_BULK.get((node_id, incarnation(record) if record is not None else None))


def _note_no_bulk(node_id: str, record: Any, reason: str) -> None:
    with _NO_BULK_LOCK:
        if len(_NO_BULK) >= MAX_NO_BULK:
            _NO_BULK.clear()
        _NO_BULK[node_id, incarnation(record) if record is not None else None] = reason


def incarnation(record: Any) -> tuple[str, float]:
    """Which process of a node a record names: a restarted node has a new start time (and, on port 0, address)."""
    return str(record.address), float(record.started_at)


def close_node_session(session: TransferSession) -> None:
    """Close a node's session; the regions (and aliases) it holds are the fleet session's, not closed by it."""
    session.regions.clear()
    with contextlib.suppress(KVStoreError):
        session.close()


def path_of(session: TransferSession) -> str:
    """What a node session reads by: "shm", "bulk" (while its bulk transport is on) or "stream"."""
    if session.path == "bulk" and session.bulk is None:
        return "stream"
    return "stream" if session.path == "auto" else session.path


class RemoteSessions:
    """A fleet session's stream and bulk sessions with the nodes (the module's docstring).

    Args:
        client: the fleet client (its pool's connections, its view's records).
        streams: Fetch calls each node session keeps in flight (as `TransferSession`'s).
        bulk: whether to read by the bulk transport where a node runs it (the fleet session's path "auto" or
            "bulk").
    """

    def __init__(self, client: Any, *, streams: int | None, bulk: bool) -> None:
        self.client = client
        self.streams = streams
        self.bulk = bulk
        #: Why a node's runs are not read by the bulk transport (node id -> its session's `bulk_reason`).
        self.bulk_reasons: dict[str, str] = {}
        #: Every node session open (closed with this object).
        self.all: list[TransferSession] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._bulk: dict[str, TransferSession] = {}
        self._bulk_locks: dict[str, threading.RLock] = {}

    def may_bulk(self, node_id: str) -> bool:
        """Whether runs may be read from `node_id` by the bulk transport: it is wanted and the node, as it is now,
        was not found to run none."""
        if not self.bulk:
            return False
        record = self.client.view.nodes.get(node_id)
        if record is None:
            return False
        reason = no_bulk_reason(node_id, record)  # this process of the node was found to run none (asked again
        if reason is not None:  # once it restarts: another incarnation)
            self.bulk_reasons[node_id] = reason
            return False
        return True

    @contextlib.contextmanager
    def remote(self, node_id: str, regions: Sequence[Region]) -> Iterator[TransferSession]:
        """The session to read `node_id` into `regions` by, held while the caller reads: the node's bulk session
        where it runs the bulk transport, the regions registered with this process's engines (counted), else this
        thread's stream session.

        Raises:
            Unavailable: the node is not in the view, or does not answer.
        """
        if self.may_bulk(node_id):
            with self._bulk_lock(node_id):
                session = self._bulk_session(node_id)
                if session is not None:
                    _hold(session, regions)
                    yield session
                    return
        session = self.stream(node_id)
        _hold(session, regions)
        yield session

    def stream(self, node_id: str) -> TransferSession:
        """This thread's stream session with `node_id` (made again when the node's connection was)."""
        mine: dict[str, TransferSession] = self._local.__dict__.setdefault("sessions", {})
        session = mine.get(node_id)
        connection = self.client.pool.connection(node_id)
        if session is None or session.connection is not connection:
            session = TransferSession(connection, path="stream", streams=self.streams, ring=False)
            mine[node_id] = session
            with self._lock:
                self.all.append(session)
        return session

    def _bulk_lock(self, node_id: str) -> threading.RLock:
        with self._lock:
            return self._bulk_locks.setdefault(node_id, threading.RLock())

    def _bulk_session(self, node_id: str) -> TransferSession | None:
        """The bulk-path session with `node_id` (made again when the node's connection was, or its session ended);
        None where the node's process serves no bulk transport (`bulk_reasons` says why). Called under the node's
        lock.

        Raises:
            Unavailable: the node is not in the view, or does not answer.
        """
        session = self._bulk.get(node_id)
        connection = self.client.pool.connection(node_id)
        if session is not None and session.connection is connection and not session.ended():
            return session
        record = self.client.view.nodes.get(node_id)
        fresh = TransferSession(connection, path="bulk", streams=self.streams, ring=False)
        if fresh.bulk is None:  # this process of the node offers none, or refused it: its runs stream
            _note_no_bulk(node_id, record, fresh.bulk_reason)
            self.bulk_reasons[node_id] = fresh.bulk_reason
            close_node_session(fresh)
            return None
        self.bulk_reasons.pop(node_id, None)
        with self._lock:
            self._bulk[node_id] = fresh
            self.all.append(fresh)
            if session is not None and session in self.all:
                self.all.remove(session)
        if session is not None:  # its regions' registrations are let go (counted: the others keep theirs)
            close_node_session(session)
        return fresh

    def bulk_sessions(self) -> dict[str, str]:
        """Node id -> the server's session id of the bulk-path session with it."""
        with self._lock:
            return {n: session.session_id for n, session in self._bulk.items()}

    def forget(self, region: Region) -> None:
        """Take `region` from every node session, unregistered from their bulk paths (before it is closed)."""
        with self._lock:
            sessions = list(self.all)
        for session in sessions:
            session.regions.pop(region.region_id, None)
            for bulk in (session.bulk, *session._closing):
                if bulk is not None:  # no engine may write into it after
                    bulk.unregister(region)

    def close(self) -> list[TransferSession]:
        """Forget every node session and hand them back to be closed (`close_node_session`)."""
        with self._lock:
            sessions, self.all = self.all, []
            self._bulk.clear()
        return sessions


def _hold(session: TransferSession, regions: Sequence[Region]) -> None:
    """Give a node session this process's regions (its paths write into them), registered with its bulk path."""
    for region in regions:
        session.regions[region.region_id] = region
        if session.bulk is not None and not session.bulk.register(region):
            session.bulk_failed(f"the client's engine could not register region {region.name}")


__all__ = ["MAX_NO_BULK", "RemoteSessions", "close_node_session", "incarnation", "no_bulk_reason", "path_of"]
