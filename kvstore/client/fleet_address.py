"""A fleet address: `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`, the etcd members a client finds the nodes in.

`kvstore.Client("etcd://10.0.0.5:2379,10.0.0.6:2379/prod")` is a fleet client of
cluster `prod` (`[fleet] cluster` of its nodes); without `/CLUSTER` the cluster is
`default`. Any other target (`host:port`) is one server, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.fleet.endpoints import Endpoint, check_cluster, parse_endpoints

#: The scheme that makes a target a fleet address.
SCHEME = "etcd://"


@dataclass(frozen=True, kw_only=True)
class FleetAddress:
    """Where a fleet's membership lives: its etcd endpoints and the cluster's name."""

    endpoints: tuple[Endpoint, ...]
    cluster: str

    def __str__(self) -> str:
        return f"{SCHEME}{','.join(str(e) for e in self.endpoints)}/{self.cluster}"


def is_fleet_address(target: object) -> bool:
    """Whether `target` names a fleet (starts with `etcd://`) rather than one server."""
    return isinstance(target, str) and target.startswith(SCHEME)


def parse_fleet_address(target: str) -> FleetAddress:
    """The endpoints and cluster of an `etcd://` target.

    Raises:
        InvalidArgument: no endpoint, an endpoint that is not host:port, or a bad cluster name.
    """
    if not is_fleet_address(target):
        raise InvalidArgument(f"{target!r} is not a fleet address", hint="write etcd://HOST:PORT[,HOST:PORT]/CLUSTER")
    hosts, _, cluster = target[len(SCHEME):].partition("/")
    try:
        endpoints = parse_endpoints(hosts)
        cluster = check_cluster(cluster.rstrip("/") or "default")
    except ConfigError as exc:
        raise InvalidArgument(f"fleet address {target!r}: {exc.message}",
                              hint="write etcd://HOST:PORT[,HOST:PORT]/CLUSTER") from None
    if not endpoints or any("://" in part for part in hosts.split(",")):
        raise InvalidArgument(f"fleet address {target!r} names no etcd endpoint as host:port",
                              hint="write etcd://HOST:PORT[,HOST:PORT]/CLUSTER")
    return FleetAddress(endpoints=endpoints, cluster=cluster)
