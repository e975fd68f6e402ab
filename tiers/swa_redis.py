"""The SWA pool in Redis: one server, or a Redis Cluster spanning machines.

Redis enforces the time bound itself: every record is SET with PX (its TTL), and
at connect kvstore sets `maxmemory` (the pool cap, per node) and
`maxmemory-policy` (volatile-lru by default) with CONFIG SET, where the server
permits it. A managed Redis that refuses CONFIG keeps its own limits; the pool
still works and logs why. The settings are applied again after the server
comes back from an outage, since a restarted Redis forgets them.

Any failure to reach Redis (refused, timed out, cluster down) becomes
`Unavailable`; redis-py reconnects on the next call, so the pool recovers
without restarting kvstore.

Keys put the tenant first, `key_prefix + hex(namespace id) + ":" + fingerprint +
snapshot key` (`redis_key`), so one glob pattern (`tenant_prefix + "*"`) covers a
tenant's keys and nothing else: the direct path's ACL users are confined by it
(tiers/swa_acl.py).

Calls go through the synchronous redis-py client on the pool's own small thread
pool rather than redis.asyncio: snapshots are megabytes, and asyncio's transport
joins and re-buffers every payload on the event loop (measured 5-10x slower for
2.6 MB values), while a blocking socket sends them straight from the buffers
with the event loop free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvstore.clock import Clock
from kvstore.config import SwaSettings
from kvstore.errors import ConfigError, FailedPrecondition, Unavailable
from kvstore.prefix import FINGERPRINT_BYTES, NAMESPACE_ID_BYTES, namespace_id
from tiers.swa_acl import AclUsers
from tiers.swa_pool import DirectGrant, PoolUsage, SwaPool, dram_cap_bytes

log = logging.getLogger("kvstore.swa.redis")
T = TypeVar("T")
#: What "Redis cannot be reached now" looks like from redis-py (ClusterDownError is a ResponseError
#: subclass in some versions, so it is matched by message in `_is_outage`).
_OUTAGE = (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError)


def _is_outage(exc: Exception) -> bool:
    if isinstance(exc, _OUTAGE):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(("CLUSTERDOWN", "TRYAGAIN", "LOADING"))


def tenant_prefix(key_prefix: bytes, tenant: str) -> bytes:
    """The start of every Redis key of `tenant`: key_prefix, its namespace id in hex, ':'."""
    return key_prefix + namespace_id(tenant).hex().encode() + b":"


def redis_key(key_prefix: bytes, storage_key: bytes) -> bytes:
    """The Redis key of a pool storage key (fingerprint | namespace id | snapshot key): the tenant first."""
    ns = storage_key[FINGERPRINT_BYTES:FINGERPRINT_BYTES + NAMESPACE_ID_BYTES]
    return (key_prefix + ns.hex().encode() + b":" + storage_key[:FINGERPRINT_BYTES]
            + storage_key[FINGERPRINT_BYTES + NAMESPACE_ID_BYTES:])


def public_url(url: str) -> str:
    """`url` without its credentials: what a direct-path client is told (it authenticates as its own user)."""
    parsed = urlsplit(url)
    host = parsed.hostname or "127.0.0.1"
    netloc = f"[{host}]" if ":" in host else host
    if parsed.port:
        netloc += f":{parsed.port}"
    return urlunsplit((parsed.scheme, netloc, parsed.path, "", ""))


class RedisPool(SwaPool):
    """Records in one Redis server, each under `key_prefix + key` with a PX expiry.

    Args:
        client: a redis-py client (a Redis or a RedisCluster).
        settings: the pool settings (prefix, cap, eviction policy).
        cap_bytes: maxmemory to set on each node.
    """

    name = "redis"

    def __init__(self, client: Any, settings: SwaSettings, *, cap_bytes: int, clock: Clock | None = None) -> None:
        self.client = client
        self.settings = settings
        self.cap_bytes = cap_bytes
        self.prefix = settings.key_prefix.encode()
        # None: limits not applied yet (first call, or the server was unreachable since).
        self._configured: bool | None = None
        # Pipelines run here, off the event loop; two lets a put overlap a get.
        self._executor = ThreadPoolExecutor(2, thread_name_prefix=f"swa-{self.name}")
        self._users = AclUsers(self._acl_command, lifetime_s=settings.direct_user_lifetime_s, clock=clock,
                               cluster=self.name == "redis-cluster") if clock is not None else None

    @classmethod
    def from_settings(cls, settings: SwaSettings, *, clock: Clock) -> RedisPool:
        """A pool on `settings.redis_url` (Redis keeps the records' time; the clock times direct-path users)."""
        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s, retry=Retry(NoBackoff(), 0))
        return cls(client, settings, cap_bytes=dram_cap_bytes(settings), clock=clock)

    # -- plumbing ----------------------------------------------------------

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    def _config_set(self, name: str, value: object) -> None:
        self.client.config_set(name, value)

    def _apply_limits(self) -> None:
        if not self.settings.configure_redis:
            self._configured = True
            return
        try:
            self._config_set("maxmemory", self.cap_bytes)
            self._config_set("maxmemory-policy", self.settings.eviction_policy)
            self._configured = True
        except ResponseError as exc:
            if _is_outage(exc):
                raise
            # Managed Redis often renames or forbids CONFIG: keep the server's own limits.
            log.warning("cannot CONFIG SET the SWA pool limits on %s (%s); using the server's own", self.name, exc)
            self._configured = False

    async def _run(self, op: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, op)

    def _call(self, op: Callable[[], T]) -> T:
        try:
            if self._configured is None:
                self._apply_limits()
            return op()
        except Exception as exc:
            if not _is_outage(exc):
                raise
            self._configured = None  # a restarted server forgets CONFIG SET: apply it again on return
            raise Unavailable(f"SWA pool {self.name} unreachable: {type(exc).__name__}: {exc}") from None

    def _k(self, key: bytes) -> bytes:
        return redis_key(self.prefix, key)

    def _acl_command(self, *args: Any) -> Any:
        return self.client.execute_command(*args)

    # -- the pool ----------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float) -> None:
        ttl_ms = max(int(ttl_s * 1000), 1)

        def op() -> None:
            pipe = self._pipeline()
            for key, record in items:
                pipe.set(self._k(key), record, px=ttl_ms)
            pipe.execute()

        await self._run(op)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def op() -> list[bytes | None]:
            pipe = self._pipeline()
            for key in keys:
                pipe.get(self._k(key))
            return list(pipe.execute())

        return await self._run(op)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        def op() -> list[bool]:
            pipe = self._pipeline()
            for key in keys:
                pipe.exists(self._k(key))
            return [bool(n) for n in pipe.execute()]

        return await self._run(op)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        def op() -> int:
            pipe = self._pipeline()
            for key in keys:
                pipe.delete(self._k(key))
            return sum(int(n) for n in pipe.execute())

        return await self._run(op)

    def _infos(self) -> list[dict[str, Any]]:
        return [self.client.info()]

    async def usage(self) -> PoolUsage:
        infos = await self._run(self._infos)
        items = sum(int(i.get("db0", {}).get("keys", 0)) for i in infos)
        return PoolUsage(
            backend=self.name, items=items,
            bytes_used=sum(int(i.get("used_memory", 0)) for i in infos),
            cap_bytes=sum(int(i.get("maxmemory", 0)) for i in infos),
            expirations=sum(int(i.get("expired_keys", 0)) for i in infos),
            evictions=sum(int(i.get("evicted_keys", 0)) for i in infos))

    # -- the direct path ----------------------------------------------------

    async def open_direct(self, tenant: str, *, writable: bool) -> DirectGrant:
        users = self._users
        if users is None or not self.settings.direct:
            return await super().open_direct(tenant, writable=writable)
        prefix = tenant_prefix(self.prefix, tenant)
        try:
            user = await self._run(lambda: users.grant(namespace_id(tenant).hex(), prefix + b"*", writable=writable))
        except ResponseError as exc:  # a managed Redis may forbid or rename ACL: no direct path, said once a call
            raise FailedPrecondition(f"the {self.name} SWA pool cannot make direct-path users: Redis refused "
                                     f"ACL ({exc}); clients use the gateway",
                                     hint="allow ACL SETUSER/DELUSER/USERS to kvstore's Redis user, or set "
                                          "swa.direct = false") from None
        now = users.clock.monotonic()
        url, nodes = self._direct_address()
        return DirectGrant(user=user, key_prefix=prefix, redis_url=url, cluster_nodes=nodes,
                           expires_in_s=max(user.expires_s - now, 0.0),
                           renew_in_s=max(user.created_s + users.lifetime_s / 2 - now, 0.0))

    def _direct_address(self) -> tuple[str, str]:
        """(redis_url, cluster_nodes) a direct-path client is told."""
        return self.settings.direct_redis_url or public_url(self.settings.redis_url), ""

    async def reap_direct(self) -> None:
        if self._users is not None:
            await self._run(self._users.reap)

    async def close(self) -> None:
        if self._users is not None:
            # Unreachable: the users die with the Redis process, or the next gateway's sweep deletes them.
            with contextlib.suppress(Unavailable):
                await self._run(self._users.delete_all)
        self._executor.shutdown(wait=True)
        self.client.close()


class RedisClusterPool(RedisPool):
    """Records spread over a Redis Cluster's masters by key slot; limits set on every master."""

    name = "redis-cluster"

    @classmethod
    def from_settings(cls, settings: SwaSettings, *, clock: Clock) -> RedisClusterPool:
        """A pool on the cluster that `settings.cluster_nodes` (host:port,...) reaches."""
        nodes = []
        for item in filter(None, (s.strip() for s in settings.cluster_nodes.split(","))):
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"swa.cluster_nodes entry {item!r} is not host:port")
            nodes.append(ClusterNode(host, int(port)))
        if not nodes:
            raise ConfigError("swa.cluster_nodes is empty: name at least one host:port of the cluster")
        client = RedisCluster(startup_nodes=nodes, socket_timeout=settings.socket_timeout_s,
                              socket_connect_timeout=settings.socket_timeout_s, retry=Retry(NoBackoff(), 1))
        return cls(client, settings, cap_bytes=dram_cap_bytes(settings), clock=clock)

    def _direct_address(self) -> tuple[str, str]:
        return "", self.settings.direct_redis_url or self.settings.cluster_nodes

    def _acl_command(self, *args: Any) -> Any:
        # ACL users live in each node, not in the cluster: every node gets every change.
        return self.client.execute_command(*args, target_nodes=RedisCluster.ALL_NODES)

    def _pipeline(self) -> Any:
        return self.client.pipeline()

    def _config_set(self, name: str, value: object) -> None:
        self.client.config_set(name, value, target_nodes=RedisCluster.PRIMARIES)

    def _infos(self) -> list[dict[str, Any]]:
        per_node = self.client.info(target_nodes=RedisCluster.PRIMARIES)
        return list(per_node.values())
