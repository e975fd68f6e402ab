"""The SWA direct path: the client reads and writes its sealed snapshots in Redis itself.

The gateway hands the tenant a Redis ACL user (SwaPool.OpenDirect): the Redis
address, a user and password, the tenant's key prefix, the TTL every SET must
carry and the largest record. This module speaks Redis with them, under the
same rules as the gateway path (docs/SWA_POOL.md "Direct path"):

- a snapshot is stored sealed (`kvstore.swa_snapshot.seal`: geometry, T and
  checksum in its header; streamed, and published sealed: kvstore.client.swa_put),
  and a record read back is opened with
  `unseal`, which checks all of them: a record that fails is a miss, counted
  as corrupt, exactly as on the gateway path;
- a snapshot of the wrong size for its T, or a record over the largest size,
  is refused here (InvalidArgument) and never sent;
- every SET carries PX: the TTL the gateway set (the tenant's, capped by the
  server's), shorter when the caller asks.

Every Redis failure is raised as a `kvstore.errors` class, never a redis-py
one: a refused, reset or timed-out connection is `Unavailable`; a refused
password or command (the user was deleted or rotated away) is
`PermissionDenied`. The SWA client turns both into one re-open and then the
gateway path.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from kvstore.client.swa_put import OVERLAP_MIN_CPUS, put_records
from kvstore.client.swa_resp import GetReplies, pack_gets
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, Unavailable
from kvstore.geometry import ModelGeometry
from kvstore.host import usable_cpus
from kvstore.swa_snapshot import HEADER_BYTES, checksum, seal, snapshot_bytes, snapshot_shape, unseal
from kvstore.v1 import swa_pb2 as pb

Buffer = bytes | bytearray | memoryview
#: Refusals Redis sends as plain error replies when the user or its password is gone.
_AUTH_REPLIES = ("WRONGPASS", "NOAUTH", "NOPERM")


def redis_error(exc: Exception) -> KVStoreError:
    """The kvstore error of a redis-py failure (raise it `from None`)."""
    if isinstance(exc, AuthenticationError | NoPermissionError) or (
            isinstance(exc, ResponseError) and str(exc).startswith(_AUTH_REPLIES)):
        return PermissionDenied(f"SWA direct path: Redis refused this client's user: {exc}",
                                hint="re-open the direct path (SwaPool.OpenDirect): the user was rotated or expired")
    return Unavailable(f"SWA direct path: Redis cannot be reached: {type(exc).__name__}: {exc}")


def size_error(geometry: ModelGeometry, index: int, size: int, position: int) -> InvalidArgument:
    """The refusal of a snapshot of `size` bytes at T = `position`, naming what it should hold
    (as the gateway's check, gateway.swa_servicer.check_snapshot, words it)."""
    shape = snapshot_shape(geometry)
    tail = (f" + the raw tail of {len(shape.ratio2_layers)} ratio-2 layers ({shape.tail_bytes} B, T is odd)"
            if position % 2 else " (T is even: no tail)")
    return InvalidArgument(
        f"items[{index}] is {size} bytes; a {geometry.name} SWA snapshot at T = {position} is "
        f"{snapshot_bytes(geometry, position)} bytes: {shape.layers} layers x {shape.window_positions(position)} "
        f"window rows of {shape.row_bytes} B{tail} (kvstore.swa_snapshot.snapshot_bytes)")


@contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except (RedisError, RedisClusterException, OSError) as exc:
        raise redis_error(exc) from None


def _cluster(grant: pb.SwaOpenDirectResponse, timeout_s: float) -> Any:
    """A Redis Cluster client on the grant's nodes, as its user."""
    nodes = []
    for item in filter(None, (s.strip() for s in grant.cluster_nodes.split(","))):
        host, _, port = item.rpartition(":")
        nodes.append(ClusterNode(host, int(port)))
    return RedisCluster(startup_nodes=nodes, username=grant.username, password=grant.password,
                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))


@dataclass(frozen=True, kw_only=True)
class DirectGets:
    """One direct get call: the snapshots (None where missing or corrupt) and what to report.

    Each snapshot is a read-only memoryview over the record Redis returned (past its
    header): no copy, and valid for as long as it is held (it keeps the record alive).
    """

    data: list[memoryview | None]
    corrupt: int


class DirectPath:
    """One tenant's snapshots in Redis, reached with the user the gateway handed out.

    Args:
        grant: the OpenDirect answer (offered).
        fingerprint: the geometry's fingerprint (part of every key and record header).
        geometry: the geometry records are checked against.
        timeout_s: how long a Redis command may take before it is `Unavailable`.
        clock: monotonic seconds (injected in tests).
        overlap: checksum a put's snapshots on a worker thread while they are sent; None: where this
            process has `swa_put.OVERLAP_MIN_CPUS` CPUs or more (kvstore.client.swa_put).
    """

    def __init__(self, grant: pb.SwaOpenDirectResponse, *, fingerprint: bytes, geometry: ModelGeometry,
                 timeout_s: float, clock: Callable[[], float] = time.monotonic, overlap: bool | None = None) -> None:
        self.tenant = grant.tenant
        self.username = grant.username
        self.writable = grant.writable
        self.ttl_ms = grant.ttl_ms
        self.max_record_bytes = grant.max_record_bytes
        #: Whether the gateway records its access trace: each call is reported with its keys
        #: (kvstore.client.swa_report).
        self.trace_calls = grant.trace_calls
        self.fingerprint = fingerprint
        self.geometry = geometry
        self.prefix = grant.key_prefix + fingerprint
        self.overlap = usable_cpus() >= OVERLAP_MIN_CPUS if overlap is None else overlap
        now = clock()
        self.clock = clock
        #: When to ask for a newer user (half its lifetime), and when this one is deleted.
        self.renew_at = now + grant.renew_after_ms / 1000
        self.expires_at = now + grant.expires_in_ms / 1000
        #: A Redis Cluster (its nodes named in the grant) or one Redis.
        self.cluster = bool(grant.cluster_nodes)
        with _mapped():
            self.redis: Any = _cluster(grant, timeout_s) if self.cluster else redis.Redis.from_url(
                grant.redis_url, username=grant.username, password=grant.password, socket_timeout=timeout_s,
                # RESP2: a GET is answered with a bulk string, a nil or an error, never with a push
                # message in between (kvstore.client.swa_resp reads those replies itself).
                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), protocol=2)

    @property
    def due(self) -> bool:
        """Whether it is time to re-open (a newer user is handed out from half the lifetime on)."""
        return self.clock() >= self.renew_at

    def key(self, snapshot_key: bytes) -> bytes:
        """The Redis key of a snapshot: the tenant's prefix, the fingerprint, the snapshot key."""
        return self.prefix + snapshot_key

    def put_many(self, triples: Sequence[tuple[bytes, int, bytes]], ttl_ms: int = 0) -> int:
        """Seal and SET PX each (key, T, snapshot); returns the bytes of snapshot data stored.

        Raises:
            InvalidArgument: a snapshot is not the size of one at its T (nothing sent).
            PermissionDenied: this user may not write (read-only grant) or was deleted.
            Unavailable: Redis cannot be reached (some snapshots may be stored).
        """
        if not self.writable:
            raise PermissionDenied("SWA direct path: this tenant's user is read-only (a byte quota, or no "
                                   "'write' right): put through the gateway")
        px = min(ttl_ms, self.ttl_ms) if ttl_ms else self.ttl_ms
        for i, (_, position, data) in enumerate(triples):
            expected = snapshot_bytes(self.geometry, position)
            if len(data) != expected or HEADER_BYTES + expected > self.max_record_bytes:
                raise size_error(self.geometry, i, len(data), position)
        with _mapped():
            if self.cluster:
                self._set_many_cluster(triples, px)
            else:
                self._set_many(triples, px)
        return sum(len(data) for _, _, data in triples)

    def _set_many_cluster(self, triples: Sequence[tuple[bytes, int, bytes]], px: int) -> None:
        """Seal and SET PX each (key, T, snapshot) through the cluster client's pipeline (which
        groups commands by node; each record is joined, a copy the single-Redis path avoids)."""
        pipe = self.redis.pipeline()
        for key, position, data in triples:
            pipe.set(self.key(key), seal(self.fingerprint, position, data, checksum(data)), px=px)
        pipe.execute()

    def _set_many(self, triples: Sequence[tuple[bytes, int, bytes]], px: int) -> None:
        """Store each (key, T, snapshot) sealed, streamed on one connection: each record to a temporary
        key under a placeholder header, sealed there (SETRANGE) and renamed into place, pipelined
        (kvstore.client.swa_put; docs/SWA_POOL.md "Direct path"). The checksum is taken on a worker
        thread beside the send where `overlap`, else piece by piece just after each is sent.

        A reader of the key sees the old record or the new one, sealed. A record any of whose commands
        was refused is removed (an empty value that expires at once: `SET ... PX 1`) from wherever it
        got to, so no placeholder or bare header stays. Not a MULTI transaction of SET and SETRANGE on
        the key: Redis keeps a queued command's arguments until EXEC ends, so the SETRANGE finds the
        value shared and copies the whole record (1-3 ms a record, measured). RESP lets a bulk string
        arrive in pieces, and each piece is a view of the caller's buffer: nothing is joined or copied.
        """
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        try:
            refused = put_records(conn, fingerprint=self.fingerprint, px=px, token=secrets.token_hex(6).encode(),
                                  targets=[self.key(key) for key, _, _ in triples],
                                  records=[(position, data) for _, position, data in triples], overlap=self.overlap)
        except BaseException:
            conn.disconnect()  # a write or a reply cut short: the connection is out of step
            raise
        finally:
            pool.release(conn)
        if refused is not None:  # every reply was read: the connection is in step and stays open
            raise refused

    def get_many(self, keys: Sequence[bytes]) -> DirectGets:
        """GET each key's record and check it with `unseal` (another geometry, a size that is not its
        T's, a bad checksum: a miss, counted as corrupt).

        Raises:
            PermissionDenied: the user was deleted or rotated away.
            Unavailable: Redis cannot be reached.
        """
        with _mapped():
            records = self._get_records_pipelined(keys) if self.cluster else self._get_records(keys)
        out: list[memoryview | None] = []
        corrupt = 0
        for record in records:
            # unseal() slices what it is given: over a memoryview the snapshot is a view, not a copy.
            opened = unseal(record, self.geometry) if record is not None else None  # type: ignore[arg-type]
            corrupt += record is not None and opened is None
            out.append(opened.data if opened is not None else None)  # type: ignore[arg-type]
        return DirectGets(data=out, corrupt=corrupt)

    def _get_records(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """GET each key, pipelined on one connection, each record received into a buffer of its own
        (kvstore.client.swa_resp: one pass over the bytes where redis-py's parser makes four); a
        read-only view of each record."""
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        # redis-py keeps a connected connection's socket in `_sock` (a test holds it to that).
        sock = getattr(conn, "_sock", None)
        if not isinstance(sock, socket.socket):
            pool.release(conn)
            return self._get_records_pipelined(keys)
        try:
            conn.send_packed_command([pack_gets([self.key(key) for key in keys])], False)
            values = GetReplies(sock, max_bytes=self.max_record_bytes).read_all(len(keys))
        except ResponseError:
            raise  # an error reply, after every reply was read: the connection is in step
        except BaseException:
            conn.disconnect()  # a reply read halfway: the connection is out of step
            raise
        finally:
            pool.release(conn)
        return [memoryview(value)[:-2].toreadonly() if value is not None else None for value in values]

    def _get_records_pipelined(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """GET each key through redis-py's pipeline (the cluster client's groups commands by node)."""
        pipe = self.redis.pipeline() if self.cluster else self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(self.key(key))
        return [memoryview(record) if record is not None else None for record in pipe.execute()]

    def close(self) -> None:
        """Close the Redis connections."""
        self.redis.close()
