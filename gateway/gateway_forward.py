"""Admin and the SWA pool through a gateway: each call forwarded to the fleet's nodes (docs/FLEET.md F52).

A gateway routes the KVStore API itself (`gateway.fleet_store`). The Admin and
SwaPool services need no routing of their own: policies, tokens and the audit
log live in etcd, so any node answers them for the whole fleet (F24-F28), and
the SWA pool is the nodes' one shared pool (F44). So the gateway forwards each
call's bytes, undecoded, to a node chosen by the method's kind, with the
caller's own `authorization` (the node checks the token again, as for routed
data calls: F38), under the caller's deadline, and relays the node's answer or
its status, message and trailing metadata as they came:

- `ANY`: policies and the audit log (GetPolicy's usage aside): one node, the
  others in turn on UNAVAILABLE or DEADLINE_EXCEEDED (a node killed stays in
  the view until its lease ends, F3).
- `EVERY`: Purge, DropPins and GetPolicy, whose work or usage is each node's:
  every live node at once; the answers summed (GetPolicy's policy is any
  node's, its usage the sum). A node that fails fails the call, naming it and
  what the others did: a purge that missed a node is not reported done.
- `POOL`: the SwaPool service, on the nodes that serve the fleet's shared pool
  (`kvstore.client.fleet_swa.pool_nodes`), in turn as `ANY`.
- ExportTenant and ImportTenant name a file on the server's disk: refused,
  FAILED_PRECONDITION naming the node to call.

Nothing is kept between calls but one channel per node address.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.client.connection import TlsOptions
from kvstore.client.fleet_swa import pool_nodes
from kvstore.errors import KVStoreError, to_status
from kvstore.v1 import admin_pb2, swa_pb2

if TYPE_CHECKING:
    from kvstore.client.fleet_view import FleetView

ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
SWA = swa_pb2.DESCRIPTOR.services_by_name["SwaPool"].full_name
ANY, EVERY, POOL, REFUSED = "any", "every", "pool", "refused"
#: How each forwarded method picks its nodes.
KINDS: dict[str, str] = {
    **{f"/{ADMIN}/{m}": ANY for m in ("SetPolicy", "ListPolicies", "PolicyLog")},
    **{f"/{ADMIN}/{m}": EVERY for m in ("GetPolicy", "Purge", "DropPins")},
    **{f"/{ADMIN}/{m}": REFUSED for m in ("ExportTenant", "ImportTenant")},
    **{f"/{SWA}/{m.name}": POOL for m in swa_pb2.DESCRIPTOR.services_by_name["SwaPool"].methods},
}
#: Statuses after which the next node is asked (the node, not the request, failed).
FAIL_OVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: Metadata keys passed to the node: the caller's token only (the gateway's own keys stay here).
PASSED = ("authorization",)


class NodeFailed(Exception):
    """A node answered a forwarded call with a status (relayed to the caller as it came)."""

    def __init__(self, node: str, error: grpc.aio.AioRpcError, details: str | None = None) -> None:
        #: What the caller is told: the node's message as it came, or with what the others did.
        self.details = details if details is not None else (error.details() or "")
        super().__init__(f"node {node}: {error.code().name}: {self.details}")
        self.node, self.error = node, error


class Forwarder(grpc.GenericRpcHandler):
    """Serves the methods of `KINDS` by forwarding them to the fleet's nodes (see the module's docstring).

    Args:
        view: the fleet's live nodes.
        tls: how to reach the nodes (None: plaintext).
    """

    def __init__(self, view: FleetView, tls: TlsOptions | None) -> None:
        self.view = view
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        #: Forwarded calls answered, per (method, node): what the tests and `kvstore gateway` logs read.
        self.forwarded: dict[tuple[str, str], int] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        kind = KINDS.get(method)
        if kind is None:
            return None

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self._forward(method, kind, request, context)

        return grpc.unary_unary_rpc_method_handler(forward)

    async def _forward(self, method: str, kind: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        metadata = tuple((k, v) for k, v in context.invocation_metadata() or () if k in PASSED)
        timeout = context.time_remaining()
        try:
            if kind == REFUSED:
                raise _refused(method, self.view)
            if kind == EVERY:
                return await self._every(method, request, metadata, timeout)
            return await self._in_turn(method, self._nodes(kind), request, metadata, timeout)
        except NodeFailed as exc:
            context.set_trailing_metadata(tuple(exc.error.trailing_metadata() or ()))
            await context.abort(exc.error.code(), exc.details)
        except KVStoreError as exc:
            await context.abort(to_status(exc), f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
        raise AssertionError("unreachable")  # pragma: no cover  (abort raises)

    def _nodes(self, kind: str) -> list[str]:
        """The nodes to try, in turn: the pool's (POOL) or every live one, in a random order (load spread)."""
        records = list(self.view.nodes.values())
        ids = pool_nodes(records) if kind == POOL else sorted(r.node_id for r in records)
        random.shuffle(ids)
        return ids

    def _channel(self, node: str) -> grpc.aio.Channel:
        record = self.view.nodes.get(node)
        if record is None:
            from kvstore.errors import Unavailable

            raise Unavailable(f"node {node} left the fleet")
        found = self._channels.get(record.address)
        if found is None:
            if self.tls is None:
                found = grpc.aio.insecure_channel(record.address)
            else:
                options = [("grpc.ssl_target_name_override", self.tls.server_name)] if self.tls.server_name else []
                found = grpc.aio.secure_channel(record.address, self.tls.credentials(), options=options)
            self._channels[record.address] = found
        return found

    async def _call(self, node: str, method: str, request: bytes, metadata: Sequence[tuple[str, str]],
                    timeout: float | None) -> bytes:
        call: Callable[..., Awaitable[bytes]] = self._channel(node).unary_unary(method)
        try:
            reply = await call(request, metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise NodeFailed(node, exc) from None
        self.forwarded[(method, node)] = self.forwarded.get((method, node), 0) + 1
        return reply

    async def _in_turn(self, method: str, nodes: list[str], request: bytes, metadata: Sequence[tuple[str, str]],
                       timeout: float | None) -> bytes:
        """One node, the next on a failure of the node (FAIL_OVER); the last failure as it came."""
        from kvstore.errors import Unavailable

        last: NodeFailed | None = None
        for node in nodes:
            try:
                return await self._call(node, method, request, metadata, timeout)
            except NodeFailed as exc:
                if exc.error.code() not in FAIL_OVER:
                    raise
                last = exc
        if last is not None:
            raise last
        raise Unavailable(f"no node of fleet {self.view.address.cluster!r} is live to forward {method} to")

    async def _every(self, method: str, request: bytes, metadata: Sequence[tuple[str, str]],
                     timeout: float | None) -> bytes:
        """Every live node at once; their answers summed (`_SUMS`)."""
        nodes = self._nodes(ANY)
        if not nodes:
            from kvstore.errors import Unavailable

            raise Unavailable(f"no node of fleet {self.view.address.cluster!r} is live to forward {method} to")
        replies = await asyncio.gather(*(self._call(n, method, request, metadata, timeout) for n in nodes),
                                       return_exceptions=True)
        failed = [(n, r) for n, r in zip(nodes, replies, strict=True) if isinstance(r, BaseException)]
        if failed:
            node, error = failed[0]
            if not isinstance(error, NodeFailed):
                raise error
            done = len(nodes) - len(failed)
            raise NodeFailed(node, error.error, f"node {node} of {len(nodes)}: {error.details} ({done} other "
                             f"node{'s' if done != 1 else ''} answered: the call is not done on every node; call "
                             "it again)")
        return _SUMS[method.rsplit("/", 1)[1]]([r for r in replies if isinstance(r, bytes)])


def _sum_fields(message: Any, replies: Sequence[Any]) -> None:
    """Add each numeric field of `replies` into `message` (same type)."""
    for field in message.DESCRIPTOR.fields:
        if field.type in (field.TYPE_STRING, field.TYPE_BYTES, field.TYPE_MESSAGE, field.TYPE_BOOL):
            continue
        setattr(message, field.name, sum(getattr(r, field.name) for r in replies))


def _summed(kind: Any) -> Callable[[list[bytes]], bytes]:
    def merge(raw: list[bytes]) -> bytes:
        replies = [kind.FromString(r) for r in raw]
        out = kind()
        _sum_fields(out, replies)
        return bytes(out.SerializeToString())
    return merge


def _policy_usage(raw: list[bytes]) -> bytes:
    """GetPolicy: the policy from etcd (any node's), the usage each node's summed; the SWA pool's bytes are the
    shared pool's, counted by every node alike (the largest)."""
    replies = [admin_pb2.GetPolicyResponse.FromString(r) for r in raw]
    out = admin_pb2.GetPolicyResponse()
    out.policy.CopyFrom(replies[0].policy)
    _sum_fields(out.usage, [r.usage for r in replies])
    out.usage.swa_bytes = max(r.usage.swa_bytes for r in replies)
    return bytes(out.SerializeToString())


_SUMS: dict[str, Callable[[list[bytes]], bytes]] = {
    "Purge": _summed(admin_pb2.PurgeResponse),
    "DropPins": _summed(admin_pb2.DropPinsResponse),
    "GetPolicy": _policy_usage,
}


def _refused(method: str, view: FleetView) -> KVStoreError:
    from kvstore.errors import FailedPrecondition

    name = method.rsplit("/", 1)[1]
    return FailedPrecondition(f"{name} names a file on the server's disk, so a gateway does not forward it",
                              hint=f"call a node of fleet {view.address} directly (kvstore fleet status lists them)")


async def close(forwarder: Forwarder) -> None:
    """Close the forwarder's channels."""
    channels, forwarder._channels = list(forwarder._channels.values()), {}
    for channel in channels:
        await channel.close()
