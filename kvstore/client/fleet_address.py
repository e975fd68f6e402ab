"""A fleet address: `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`, the etcd members a client finds the nodes in.

`kvstore.Client("etcd://10.0.0.5:2379,10.0.0.6:2379/prod")` is a fleet client of
cluster `prod` (`[fleet] cluster` of its nodes); without `/CLUSTER` the cluster is
`default`. Any other target (`host:port`) is one server, as before.

`etcds://` is the same over TLS to etcd (docs/FLEET.md F57): etcd's certificate is
checked against the system's roots, or the CA named by `?ca_file=PATH`, and
`&cert_file=PATH&key_file=PATH` is the certificate shown to an etcd run with
--client-cert-auth (`FleetClient(etcd_tls=)` gives the same in code).

Either scheme takes `?user=NAME&password_file=PATH` (with etcds:// beside the TLS
files, joined by `&`) for an etcd with its user authentication on (docs/FLEET.md
F70): the client authenticates as that user with the password on the file's first
line. The query names only files on this host, never a secret itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from urllib.parse import parse_qsl, urlencode

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.fleet.endpoints import Endpoint, EtcdAuth, EtcdTls, check_cluster, parse_endpoints

#: The scheme that makes a target a fleet address.
SCHEME = "etcd://"
#: The same, over TLS to etcd.
TLS_SCHEME = "etcds://"
_HINT = ("write etcd://HOST:PORT[,HOST:PORT]/CLUSTER, or etcds://HOST:PORT/CLUSTER?ca_file=PATH for TLS to etcd; "
         "either takes user=NAME&password_file=PATH for etcd's authentication")
#: The query's names: EtcdTls's fields (etcds:// only), and EtcdAuth's.
_TLS_FIELDS = tuple(f.name for f in fields(EtcdTls))
_AUTH_FIELDS = tuple(f.name for f in fields(EtcdAuth))


@dataclass(frozen=True, kw_only=True)
class FleetAddress:
    """Where a fleet's membership lives: its etcd endpoints, the cluster's name, and TLS to etcd (None: plaintext)."""

    endpoints: tuple[Endpoint, ...]
    cluster: str
    tls: EtcdTls | None = None
    #: etcd's user authentication (F70; None: no user).
    auth: EtcdAuth | None = None

    def __str__(self) -> str:
        hosts = f"{','.join(str(e) for e in self.endpoints)}/{self.cluster}"
        named = {name: getattr(self.tls, name) for name in _TLS_FIELDS if self.tls and getattr(self.tls, name)}
        if self.auth is not None:
            named.update({name: getattr(self.auth, name) for name in _AUTH_FIELDS})
        query = urlencode(named)
        return (SCHEME if self.tls is None else TLS_SCHEME) + hosts + (f"?{query}" if query else "")


def is_fleet_address(target: object) -> bool:
    """Whether `target` names a fleet (starts with `etcd://` or `etcds://`) rather than one server."""
    return isinstance(target, str) and target.startswith((SCHEME, TLS_SCHEME))


def parse_fleet_address(target: str) -> FleetAddress:
    """The endpoints, cluster and TLS files of an `etcd://` or `etcds://` target.

    Raises:
        InvalidArgument: no endpoint, an endpoint that is not host:port, a bad cluster name, or a query that is
            not TLS files of an etcds:// address.
    """
    if not is_fleet_address(target):
        raise InvalidArgument(f"{target!r} is not a fleet address", hint=_HINT)
    tls_on = target.startswith(TLS_SCHEME)
    rest, _, query = target[len(TLS_SCHEME if tls_on else SCHEME):].partition("?")
    hosts, _, cluster = rest.partition("/")
    try:
        endpoints = parse_endpoints(hosts)
        cluster = check_cluster(cluster.rstrip("/") or "default")
        named = _query(query, _TLS_FIELDS + _AUTH_FIELDS if tls_on else _AUTH_FIELDS,
                       "an etcds:// query" if tls_on else "an etcd:// query (TLS files only an etcds:// address takes)")
        tls = EtcdTls(**{k: v for k, v in named.items() if k in _TLS_FIELDS}) if tls_on else None
        wanted = {k: v for k, v in named.items() if k in _AUTH_FIELDS}
        auth = EtcdAuth(**{"user": "", "password_file": "", **wanted}) if wanted else None
    except ConfigError as exc:
        raise InvalidArgument(f"fleet address {target!r}: {exc.message}", hint=_HINT) from None
    if not endpoints or any("://" in part for part in hosts.split(",")):
        raise InvalidArgument(f"fleet address {target!r} names no etcd endpoint as host:port", hint=_HINT)
    return FleetAddress(endpoints=endpoints, cluster=cluster, tls=tls, auth=auth)


def _query(query: str, allowed: tuple[str, ...], what: str) -> dict[str, str]:
    """The names and values of an address's query, each of `allowed` at most once.

    Raises:
        ConfigError: not name=value pairs, a name not allowed, or one named twice.
    """
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"the query {query!r} is not name=value pairs joined by '&'") from None
    names = [name for name, _ in pairs]
    unknown = sorted(set(names) - set(allowed))
    if unknown or len(set(names)) != len(names):
        raise ConfigError(f"the query names {', '.join(unknown) or 'one name twice'}: {what} takes "
                          f"{', '.join(allowed)}, each once")
    return dict(pairs)
