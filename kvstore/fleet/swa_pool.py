"""Which SWA pool a node serves, as it records it in etcd (docs/FLEET.md F44).

A fleet's SWA snapshots live in one pool every node shares (a Redis Cluster, or
one Redis); the embedded `memory` pool is each node's own, the one-node
default. A node records its pool's name in its `NodeRecord.swa_pool`, so a
fleet client can tell which nodes share a pool without asking each: two nodes
share one exactly when they record the same name. The name never holds a
password.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from kvstore.config_sections import SwaSettings

#: The name of a node's own embedded pool (shared with no other node).
MEMORY = "memory"


def _without_credentials(url: str) -> str:
    """`url` with any user and password dropped (what clients may be told)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def pool_name(swa: SwaSettings) -> str:
    """The name of the pool `swa` configures: `memory`, `redis URL PREFIX` or `redis-cluster NODES PREFIX`.

    The cluster's startup nodes are sorted, so nodes listing the same ones in another order agree; the key
    prefix is part of it, since two prefixes in one Redis keep two pools apart.
    """
    if swa.backend == "redis":
        return f"redis {_without_credentials(swa.redis_url)} {swa.key_prefix}"
    if swa.backend == "redis-cluster":
        nodes = ",".join(sorted(n.strip() for n in swa.cluster_nodes.split(",") if n.strip()))
        return f"redis-cluster {nodes} {swa.key_prefix}"
    return MEMORY


def is_shared(name: str) -> bool:
    """Whether a recorded pool name is one other nodes can share (a Redis backend); '' is an older node's."""
    return name.startswith(("redis ", "redis-cluster "))
