"""The seam of the SWA DRAM pool: one ABC, its backends by name, and how its cap is sized.

Pool rules (docs/SWA_POOL.md numbers them; tests are named after them):
1. Every record has a TTL; after it, a get misses.
2. The pool never holds more than its byte cap: it evicts (least recently used
   first in memory; Redis's maxmemory-policy in Redis) rather than refuse.
3. Expiry and eviction are misses, never errors.
4. A backend that cannot be reached raises `Unavailable`; the cache above turns
   that into misses and a counted error.

Records are opaque bytes here; sealing and checks live in tiers/swa_cache.py.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.clock import Clock
from kvstore.config import SwaSettings
from kvstore.errors import ConfigError, FailedPrecondition


@dataclass(frozen=True, kw_only=True)
class PoolUsage:
    """What a pool holds and has dropped, as its backend reports it."""

    backend: str
    items: int
    bytes_used: int
    cap_bytes: int
    expirations: int
    evictions: int


@dataclass(frozen=True, kw_only=True)
class DirectUser:
    """A direct-path user of the backend: its credentials and lifetime (monotonic seconds)."""

    username: str
    password: str
    writable: bool
    created_s: float
    expires_s: float


@dataclass(frozen=True, kw_only=True)
class DirectGrant:
    """What a tenant's client needs to reach the backend itself: where, as whom, under which keys."""

    user: DirectUser
    redis_url: str
    #: Every key of the tenant starts with it: key_prefix + geometry fingerprint + snapshot key.
    key_prefix: bytes
    #: Seconds from the grant until the user is deleted, and until a newer one is handed out.
    expires_in_s: float
    renew_in_s: float
    #: A Redis Cluster's nodes (host:port,...); '' for a single Redis (`redis_url`).
    cluster_nodes: str = ""


class SwaPool(abc.ABC):
    """A time-bounded key-value pool of SWA records; batched methods only."""

    name: str = ""

    @abc.abstractmethod
    async def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float) -> None:
        """Store each (key, record) for `ttl_s` seconds, replacing any record under that key.

        Raises:
            Unavailable: the backend cannot be reached (some records may be stored).
        """

    @abc.abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The record under each key, None where missing, expired or evicted.

        Raises:
            Unavailable: the backend cannot be reached.
        """

    @abc.abstractmethod
    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a live record (cheaper than get_many: no bytes move)."""

    @abc.abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Drop the records under `keys`; returns how many existed."""

    @abc.abstractmethod
    async def usage(self) -> PoolUsage:
        """Items, bytes in use against the cap, expirations and evictions so far."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections."""

    async def open_direct(self, tenant: str, *, writable: bool) -> DirectGrant:
        """A backend user confined to `tenant`'s keys, for the direct path.

        Raises:
            FailedPrecondition: this backend has no direct path (the default).
            Unavailable: the backend cannot be reached.
        """
        raise FailedPrecondition(f"the {self.name} SWA pool has no direct path: clients use the gateway")

    async def reap_direct(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Delete direct-path users past their lifetime."""


#: Backend name -> "module:Class". Modules load only when chosen, so the
#: embedded default never imports redis.
BACKENDS: dict[str, str] = {
    "memory": "tiers.swa_memory:MemoryPool",
    "redis": "tiers.swa_redis:RedisPool",
    "redis-cluster": "tiers.swa_redis:RedisClusterPool",
}


def dram_cap_bytes(settings: SwaSettings, meminfo: Path = Path("/proc/meminfo")) -> int:
    """The pool's byte cap: `cap_bytes`, or `memory_fraction` of this node's MemTotal.

    Raises:
        ConfigError: cap_bytes is 0 and MemTotal cannot be read.
    """
    if settings.cap_bytes:
        return settings.cap_bytes
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(int(line.split()[1]) * 1024 * settings.memory_fraction)
    except (OSError, ValueError, IndexError):
        pass
    raise ConfigError(f"cannot read MemTotal from {meminfo}; set swa.cap_bytes explicitly")


def open_pool(settings: SwaSettings, *, clock: Clock) -> SwaPool:
    """The backend `settings.backend` names, built from `settings`.

    Raises:
        ConfigError: an unknown backend name.
    """
    path = BACKENDS.get(settings.backend)
    if path is None:
        raise ConfigError(f"unknown swa.backend {settings.backend!r}; known: {', '.join(BACKENDS)}")
    module, cls = path.split(":")
    pool: SwaPool = getattr(importlib.import_module(module), cls).from_settings(settings, clock=clock)
    return pool
