"""Who is calling: the auth interceptor and the caller of the call being served.

Every call but the health check carries `authorization: Bearer <token>`
metadata while auth is on (gateway.tenants). The interceptor, first in the
chain, checks it and the right the method needs (`METHOD_RIGHTS`) before any
servicer code runs, and puts the caller where the rest of the call finds it
(`current_caller()`):

- no token, a malformed one, an unknown or revoked one, or more than one
  `authorization` entry (never a guess at which counts): UNAUTHENTICATED;
- a valid token without the method's right: PERMISSION_DENIED naming it.

The tenant comes from the token only: `gateway.validate.scope` maps an empty
namespace to the caller's tenant and refuses any other (admins may name any).

Auth off (no tenants file, `auth.required` false): every call is the "default"
tenant. On a loopback-only bind that caller has every right (the two-command
start); beyond loopback (`--insecure`) it has read and write but not admin.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.tenants import TokenTable
from kvstore.api_tokens import ADMIN, READ, RIGHTS, WRITE
from kvstore.errors import ConfigError, PermissionDenied

#: The tenant of every call while auth is off.
DEFAULT_TENANT = "default"
#: A method anyone may call, with or without a token (the health check: probes send no metadata).
OPEN = "open"
#: A method any valid token may call, whatever its rights.
ANY = "any"


@dataclass(frozen=True)
class Caller:
    """Who makes the call being served: the token's tenant and rights (among read, write, admin)."""

    tenant: str
    rights: frozenset[str]


#: The caller with every right: auth off on a loopback-only bind, and code running outside any call.
OPEN_CALLER = Caller(DEFAULT_TENANT, frozenset(RIGHTS))
_CALLER: ContextVar[Caller] = ContextVar("kvstore_caller", default=OPEN_CALLER)

_KV, _SWA, _TR = "/kvstore.v1.KVStore/", "/kvstore.v1.SwaPool/", "/kvstore.v1.Transfer/"
#: The right each method needs. A method not listed needs "admin" (fail closed: a service
#: added later, the Admin service among them, is an admin's until listed here).
METHOD_RIGHTS: dict[str, str] = {
    **{_KV + m: READ for m in ("Lookup", "Get", "Release", "ReportResume")},
    # A same-host reader's checksum failures: the server re-verifies them itself (gateway.kvstore_servicer).
    _KV + "ReportCorrupt": READ,
    **{_KV + m: WRITE for m in ("Put", "PutStream")},
    _KV + "GetInfo": ANY,
    # KVStore's Stats answer a tenant its own hit counters only (gateway.kvstore_servicer),
    # SwaPool's the pool's settings only (gateway.swa_servicer), which its client needs;
    # Transfer's span every session of every tenant: admins only.
    _KV + "Stats": READ, _SWA + "Stats": READ, _TR + "Stats": ADMIN,
    _SWA + "Get": READ, _SWA + "Put": WRITE, _SWA + "Delete": WRITE,
    # The direct path: the user handed out can write only with the "write" right (gateway.swa_servicer).
    _SWA + "OpenDirect": READ, _SWA + "ReportDirect": READ,
    # A session reads; a batch that writes also needs "write" (gateway.transfer_servicer).
    **{_TR + m: READ for m in ("OpenSession", "RegisterRegion", "DeregisterRegion", "Submit", "SubmitMany",
                               "GetTransfer", "GetTransfers")},
    _TR + "Fetch": READ,  # blocks of the caller's own tenant (validate.scope), as Get
    # The bulk transport: a session's reads, scoped as Submit's (gateway.transfer_bulk).
    _TR + "OpenBulk": READ, _TR + "BulkFetch": READ, _TR + "BulkDrain": READ,
    # A Put over the TCP transport: its grant is PutStream's (gateway/transfer_tcp_put.py).
    _TR + "OpenPut": WRITE,
    "/grpc.health.v1.Health/Check": OPEN, "/grpc.health.v1.Health/Watch": OPEN,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ANY,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": ANY,
}


def current_caller() -> Caller:
    """The caller of the call being served (valid in servicers and in interceptors after auth's)."""
    return _CALLER.get()


def set_caller(caller: Caller) -> None:
    """Make `caller` the caller of what the running task (or thread) serves from now on: for work that
    arrives outside gRPC on a caller's behalf (a Put over the TCP transport, granted by a gRPC call)."""
    _CALLER.set(caller)


def require(right: str) -> Caller:
    """The caller, when it holds `right`.

    Raises:
        PermissionDenied: naming the right and the caller's tenant.
    """
    caller = _CALLER.get()
    if right not in caller.rights:
        raise PermissionDenied(f"this call needs the {right!r} right; the token of tenant {caller.tenant!r} "
                               f"holds {', '.join(sorted(caller.rights)) or 'none'}",
                               hint="ask an operator for a token with that right (`kvstore tenant create`)")
    return caller


def open_caller(host: str) -> Caller:
    """Who a call without a token is on a server bound to `host`: the default tenant, with every right on
    loopback (the two-command start), without "admin" beyond it."""
    return OPEN_CALLER if is_loopback(host) else Caller(DEFAULT_TENANT, frozenset({READ, WRITE}))


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere, or '' (every address)


def check_bind(host: str, *, auth: bool, tls: bool, insecure: bool) -> None:
    """Refuse to serve beyond loopback without both tokens and TLS, unless `insecure`.

    Raises:
        ConfigError: naming what is missing and the ways out.
    """
    if is_loopback(host) or (auth and tls) or insecure:
        return
    missing = " and ".join(m for m, ok in (("auth (no tenants file)", auth), ("TLS (tls.cert_file)", tls)) if not ok)
    raise ConfigError(
        f"refusing to serve on {host} without {missing}: any host could read, overwrite or delete every "
        "tenant's blocks",
        hint="create a tenant (`kvstore tenant create NAME --data-dir DIR`) and set tls.cert_file and "
             "tls.key_file, bind 127.0.0.1, or pass --insecure (auth.insecure) on a trusted network")


def check_metrics_bind(host: str, port: int, *, insecure: bool) -> None:
    """Refuse the metrics endpoint (on while `port` is not 0) beyond loopback unless `insecure`: it is
    plain HTTP without tokens, and its series name every tenant.

    Raises:
        ConfigError: naming the address and the ways out.
    """
    if port == 0 or is_loopback(host) or insecure:
        return
    raise ConfigError(
        f"refusing to serve metrics on {host}:{port} (metrics.host) over plain HTTP without tokens: any host "
        "could read every tenant's name and traffic",
        hint="bind metrics.host 127.0.0.1 (a Prometheus on this host or through a tunnel), or set "
             "metrics.insecure = true (or pass --insecure) on a trusted network")


def _refusal(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of `handler`'s shape that answers `code` without running the method."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call and checks the right its method needs; first in the chain.

    Args:
        registry: the tenants' tokens (auth is on while `registry.enabled`).
        open_caller: the caller of every call while auth is off.
        rights: method full name -> right needed (default `METHOD_RIGHTS`; unlisted: admin).
    """

    def __init__(self, registry: TokenTable, open_caller: Caller,
                 rights: Mapping[str, str] = METHOD_RIGHTS) -> None:
        self.registry = registry
        self.open_caller = open_caller
        self.rights = dict(rights)

    def authenticate(self, metadata: Any) -> Caller | tuple[grpc.StatusCode, str]:
        """The caller a call's metadata names, or the status and message refusing it."""
        if not self.registry.enabled:
            return self.open_caller
        values = [v for key, v in metadata or () if key == "authorization"]
        if not values:
            return grpc.StatusCode.UNAUTHENTICATED, ("no token: send `authorization: Bearer <token>` metadata "
                                                     "(kvstore.Client(token=...), --token or KVSTORE_TOKEN)")
        if len(values) > 1:
            # Which one counts would be a guess (a proxy may have added one): refuse rather than pick.
            return grpc.StatusCode.UNAUTHENTICATED, (f"the call carries {len(values)} authorization metadata "
                                                     "entries: send exactly one `authorization: Bearer <token>`")
        value = values[0]
        if not isinstance(value, str) or not value.startswith("Bearer "):
            return grpc.StatusCode.UNAUTHENTICATED, "the authorization metadata is not `Bearer <token>`"
        identity = self.registry.find(value[7:])
        if identity is None:
            return grpc.StatusCode.UNAUTHENTICATED, "the token is unknown or revoked"
        return Caller(identity.tenant, identity.rights)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method  # type: ignore[attr-defined]
        need = self.rights.get(method, ADMIN)
        if need == OPEN:
            return await continuation(handler_call_details)
        caller = self.authenticate(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        if isinstance(caller, tuple):
            handler = await continuation(handler_call_details)
            return None if handler is None else _refusal(handler, *caller)
        if need != ANY and need not in caller.rights:
            _CALLER.set(caller)  # the refusal is the token's tenant's (metrics and the request log say so)
            handler = await continuation(handler_call_details)
            message = (f"{method} needs the {need!r} right; this token of tenant {caller.tenant!r} holds "
                       f"{', '.join(sorted(caller.rights))}")
            return None if handler is None else _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, message)
        # The call runs in this task, after this coroutine: what is set here is what it sees.
        _CALLER.set(caller)
        return await continuation(handler_call_details)
