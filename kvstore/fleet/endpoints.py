"""The etcd endpoints a `[fleet] etcd` setting names, and the keys a cluster's records live under.

Kept apart from `kvstore.fleet.etcd` so that the settings can check the endpoints
at load without importing the etcd client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    import grpc

#: A cluster's name: one path segment of its keys.
_CLUSTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_HOST = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")
#: Every key of every cluster starts with this.
KEY_ROOT = "/kvstore"


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """One etcd member's client address."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class EtcdTls:
    """TLS to etcd (docs/FLEET.md F57): the CA that signed etcd's certificate ('' = the system's roots) and
    this process's own certificate and key, for an etcd run with --client-cert-auth ('' = none)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("TLS to etcd takes a client certificate and its key together "
                              f"(cert_file={self.cert_file!r}, key_file={self.key_file!r})",
                              hint="set both [fleet] etcd_cert_file and etcd_key_file, or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC's channel credentials of these files, read now (a restart reads renewed ones).

        Raises:
            ConfigError: a file that cannot be read (naming it).
        """
        import grpc

        def read(path: str, what: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"the etcd TLS {what} {path!r} cannot be read: {exc.strerror}",
                                  hint="check [fleet] etcd_ca_file, etcd_cert_file and etcd_key_file") from None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file, "CA file"),
                                            private_key=read(self.key_file, "key file"),
                                            certificate_chain=read(self.cert_file, "certificate file"))


@dataclass(frozen=True, kw_only=True)
class EtcdAuth:
    """etcd's user authentication (docs/FLEET.md F70): the user this process authenticates as and the file its
    password is read from (its first line), never the password itself, so it is in no config, command line or log.
    """

    user: str
    password_file: str

    def __post_init__(self) -> None:
        if not self.user or not self.password_file:
            raise ConfigError("etcd authentication takes a user and a password file together "
                              f"(user={self.user!r}, password_file={self.password_file!r})",
                              hint="set both [fleet] etcd_user and etcd_password_file (an address: "
                                   "?user=NAME&password_file=PATH), or neither")
        if any(c in self.user for c in "\r\n\0"):
            raise ConfigError(f"etcd user {self.user!r} has a line break or NUL in it")

    def password(self) -> str:
        """The password: the file's first line, its line ending dropped; read now (a restart reads a new one).

        Raises:
            ConfigError: the file cannot be read or its first line is empty (naming the file, never its text).
        """
        try:
            text = Path(self.password_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
            raise ConfigError(f"etcd user {self.user!r}'s password file {self.password_file!r} cannot be read: {why}",
                              hint="check [fleet] etcd_password_file (or the address's password_file=)") from None
        password = text.split("\n", 1)[0].rstrip("\r")
        if not password:
            raise ConfigError(f"etcd user {self.user!r}'s password file {self.password_file!r} has an empty first "
                              "line", hint="write the password on the file's first line")
        return password


#: The schemes an endpoint may carry: http:// is plaintext gRPC, https:// is TLS (`endpoints_use_tls`).
_SCHEMES = ("http", "https")


def endpoints_use_tls(text: str) -> bool:
    """Whether a `[fleet] etcd` list names its members with https:// (TLS); all of them or none.

    Raises:
        ConfigError: some entries https:// and others not.
    """
    schemes = {part.strip().split("://", 1)[0] if "://" in part else "" for part in text.split(",") if part.strip()}
    if "https" in schemes and schemes != {"https"}:
        raise ConfigError(f"fleet.etcd = {text!r} mixes https:// with plaintext endpoints",
                          hint="one etcd cluster speaks TLS on every member or on none: write them all https://")
    return schemes == {"https"}


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """The endpoints of a comma-separated list of `host:port`, `http://host:port` or `https://host:port` (TLS:
    `endpoints_use_tls`).

    Raises:
        ConfigError: an entry without a port, with a port out of range, a scheme other
            than http or https, or a path.
    """
    found: list[Endpoint] = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        rest = raw
        if "://" in rest:
            scheme, rest = rest.split("://", 1)
            if scheme not in _SCHEMES:
                raise ConfigError(f"fleet.etcd endpoint {raw!r}: the scheme is http:// (plaintext gRPC) or https:// "
                                  "(TLS)", hint="give etcd's client URLs as host:port, http:// or https://host:port")
        host, sep, port = rest.rstrip("/").rpartition(":")
        if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"fleet.etcd endpoint {raw!r} is not host:port",
                              hint="for example fleet.etcd = \"10.0.0.5:2379,10.0.0.6:2379\"")
        found.append(Endpoint(host=host, port=int(port)))
    return tuple(found)


def check_cluster(name: str) -> str:
    """The cluster name, checked: one path segment of letters, digits, '.', '_' or '-'.

    Raises:
        ConfigError: naming the value.
    """
    if not _CLUSTER.fullmatch(name):
        raise ConfigError(f"fleet.cluster = {name!r}: use 1 to 63 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return name


def nodes_prefix(cluster: str) -> bytes:
    """The prefix every node record of `cluster` lives under: `/kvstore/<cluster>/nodes/`."""
    return f"{KEY_ROOT}/{cluster}/nodes/".encode()


def node_key(cluster: str, node_id: str) -> bytes:
    """The key of one node's record: `/kvstore/<cluster>/nodes/<node_id>`."""
    return nodes_prefix(cluster) + node_id.encode()


def layout_key(cluster: str) -> bytes:
    """The key of the cluster's placement layout (run and block sizes every member must share)."""
    return f"{KEY_ROOT}/{cluster}/layout".encode()


def tenants_prefix(cluster: str) -> bytes:
    """The prefix of the tenants' token records (hashes only): `/kvstore/<cluster>/tenants/`."""
    return f"{KEY_ROOT}/{cluster}/tenants/".encode()


def token_key(cluster: str, token_id: str) -> bytes:
    """The key of one token's record: `/kvstore/<cluster>/tenants/<token_id>`."""
    return tenants_prefix(cluster) + token_id.encode()


def policies_prefix(cluster: str) -> bytes:
    """The prefix of the tenants' policies: `/kvstore/<cluster>/policies/`."""
    return f"{KEY_ROOT}/{cluster}/policies/".encode()


def policy_key(cluster: str, tenant: str) -> bytes:
    """The key of one tenant's own policy fields: `/kvstore/<cluster>/policies/<tenant>`."""
    return policies_prefix(cluster) + tenant.encode()


#: The policies' record of the defaults (`retention_floor_hours`): a name no tenant can have (they start
#: with a letter or digit), inside the prefix, so one watch follows it with the tenants' policies.
POLICY_DEFAULTS = ".defaults"


def audit_prefix(cluster: str) -> bytes:
    """The prefix of the audit log's entries: `/kvstore/<cluster>/audit/`, in time order by key."""
    return f"{KEY_ROOT}/{cluster}/audit/".encode()


def imported_key(cluster: str, table: str) -> bytes:
    """The marker a node writes when it imports its data dir's `table` file into etcd (once per cluster)."""
    return f"{KEY_ROOT}/{cluster}/imported/{table}".encode()
