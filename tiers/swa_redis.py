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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.clock import Clock
from kvstore.config import SwaSettings
from kvstore.errors import ConfigError, Unavailable
from tiers.swa_pool import PoolUsage, SwaPool, dram_cap_bytes

log = logging.getLogger("kvstore.swa.redis")
T = TypeVar("T")
#: What "Redis cannot be reached now" looks like from redis-py (ClusterDownError is a ResponseError
#: subclass in some versions, so it is matched by message in `_is_outage`).
_OUTAGE = (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError)


def _is_outage(exc: Exception) -> bool:
    if isinstance(exc, _OUTAGE):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(("CLUSTERDOWN", "TRYAGAIN", "LOADING"))


class RedisPool(SwaPool):
    """Records in one Redis server, each under `key_prefix + key` with a PX expiry.

    Args:
        client: a redis.asyncio client (a Redis or a RedisCluster).
        settings: the pool settings (prefix, cap, eviction policy).
        cap_bytes: maxmemory to set on each node.
    """

    name = "redis"

    def __init__(self, client: Any, settings: SwaSettings, *, cap_bytes: int) -> None:
        self.client = client
        self.settings = settings
        self.cap_bytes = cap_bytes
        self.prefix = settings.key_prefix.encode()
        # None: limits not applied yet (first call, or the server was unreachable since).
        self._configured: bool | None = None

    @classmethod
    def from_settings(cls, settings: SwaSettings, *, clock: Clock) -> RedisPool:
        """A pool on `settings.redis_url` (the clock is unused: Redis keeps time)."""
        client = aioredis.Redis.from_url(
            settings.redis_url, socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s, retry=Retry(NoBackoff(), 0))
        return cls(client, settings, cap_bytes=dram_cap_bytes(settings))

    # -- plumbing ----------------------------------------------------------

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False)

    async def _config_set(self, name: str, value: object) -> None:
        await self.client.config_set(name, value)

    async def _apply_limits(self) -> None:
        if not self.settings.configure_redis:
            self._configured = True
            return
        try:
            await self._config_set("maxmemory", self.cap_bytes)
            await self._config_set("maxmemory-policy", self.settings.eviction_policy)
            self._configured = True
        except ResponseError as exc:
            if _is_outage(exc):
                raise
            # Managed Redis often renames or forbids CONFIG: keep the server's own limits.
            log.warning("cannot CONFIG SET the SWA pool limits on %s (%s); using the server's own", self.name, exc)
            self._configured = False

    async def _run(self, op: Callable[[], Awaitable[T]]) -> T:
        try:
            if self._configured is None:
                await self._apply_limits()
            return await op()
        except Exception as exc:
            if not _is_outage(exc):
                raise
            self._configured = None  # a restarted server forgets CONFIG SET: apply it again on return
            raise Unavailable(f"SWA pool {self.name} unreachable: {type(exc).__name__}: {exc}") from None

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key

    # -- the pool ----------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float) -> None:
        ttl_ms = max(int(ttl_s * 1000), 1)

        async def op() -> None:
            pipe = self._pipeline()
            for key, record in items:
                pipe.set(self._k(key), record, px=ttl_ms)
            await pipe.execute()

        await self._run(op)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        async def op() -> list[bytes | None]:
            pipe = self._pipeline()
            for key in keys:
                pipe.get(self._k(key))
            return list(await pipe.execute())

        return await self._run(op)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        async def op() -> list[bool]:
            pipe = self._pipeline()
            for key in keys:
                pipe.exists(self._k(key))
            return [bool(n) for n in await pipe.execute()]

        return await self._run(op)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        async def op() -> int:
            pipe = self._pipeline()
            for key in keys:
                pipe.delete(self._k(key))
            return sum(int(n) for n in await pipe.execute())

        return await self._run(op)

    async def _infos(self) -> list[dict[str, Any]]:
        return [await self.client.info()]

    async def usage(self) -> PoolUsage:
        infos = await self._run(self._infos)
        items = sum(int(i.get("db0", {}).get("keys", 0)) for i in infos)
        return PoolUsage(
            backend=self.name, items=items,
            bytes_used=sum(int(i.get("used_memory", 0)) for i in infos),
            cap_bytes=sum(int(i.get("maxmemory", 0)) for i in infos),
            expirations=sum(int(i.get("expired_keys", 0)) for i in infos),
            evictions=sum(int(i.get("evicted_keys", 0)) for i in infos))

    async def close(self) -> None:
        await self.client.aclose()


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
        return cls(client, settings, cap_bytes=dram_cap_bytes(settings))

    def _pipeline(self) -> Any:
        return self.client.pipeline()

    async def _config_set(self, name: str, value: object) -> None:
        await self.client.config_set(name, value, target_nodes=RedisCluster.PRIMARIES)

    async def _infos(self) -> list[dict[str, Any]]:
        per_node = await self.client.info(target_nodes=RedisCluster.PRIMARIES)
        return list(per_node.values())
