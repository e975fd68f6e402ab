"""Per-tenant quotas at the wire: requests per second, and snapshot bytes in the SWA pool.

`QuotaInterceptor` is one server interceptor, placed after the auth interceptor
(it asks who the caller is). On every data RPC (the KVStore, SwaPool and
Transfer services; never Admin, health or reflection) it:

- takes one token from the caller's bucket (`RequestRate`): a bucket holds one
  second of the tenant's `requests_per_s` and refills continuously; an empty
  one answers RESOURCE_EXHAUSTED naming the limit and the tenant. The bucket is
  the caller's (its token's tenant), never one a request field names, so no
  tenant can drain another's;
- on SwaPool.Put, caps the TTL at the tenant's `swa_ttl_s` and charges the
  snapshots to the tenant's `SwaLedger` entry, refusing the Put (nothing stored)
  when the tenant's live snapshot bytes would pass `swa_quota_bytes`; on
  SwaPool.Delete, takes the deleted keys off the ledger.

The ledger counts a snapshot until its TTL ends or it is deleted. The pool may
drop one sooner (evicted under memory pressure, a Redis restart), which the
ledger does not see: it can only overstate what a tenant holds, never let it
hold more than its quota.

The NVMe quota is enforced by the tier inside the Put's write transaction
(per-namespace usage there is exact), not here.
"""

from __future__ import annotations

import heapq
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.auth import current_caller
from gateway.call_outcome import note_error
from gateway.policies import PolicyTable
from gateway.validate import namespace as checked_namespace
from kvstore import geometry
from kvstore.clock import Clock, SystemClock
from kvstore.errors import KVStoreError, ResourceExhausted, to_status

#: Services whose every method is a data RPC, charged to the caller's request rate.
DATA_SERVICES = ("kvstore.v1.KVStore", "kvstore.v1.SwaPool", "kvstore.v1.Transfer")
SWA_PUT = "/kvstore.v1.SwaPool/Put"
SWA_DELETE = "/kvstore.v1.SwaPool/Delete"
Handler = Any


class QuotaExceeded(ResourceExhausted):
    """A tenant's quota (named in the message) would be passed."""

    hint = "retry later, or ask an admin to raise the quota (`kvstore policy set TENANT ...`)"


class RequestRate:
    """Token buckets of requests per second, one per tenant, sized by its policy.

    Args:
        policies: where each tenant's `requests_per_s` is read (at every call, so a change applies at once).
        clock: its monotonic face measures refills.
    """

    def __init__(self, policies: PolicyTable, clock: Clock) -> None:
        self.policies = policies
        self.clock = clock
        #: tenant -> (tokens, monotonic time of the last refill)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str) -> None:
        """Spend one request of `tenant`'s bucket.

        Raises:
            QuotaExceeded: the bucket is empty.
        """
        rate = self.policies.policy(tenant).requests_per_s
        if not rate:
            return
        burst = max(rate, 1.0)  # one second of requests, and always room for one
        now = self.clock.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(tenant, (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[tenant] = (tokens, now)
                raise QuotaExceeded(f"tenant {tenant!r} is over its requests_per_s quota of {rate:g} requests/s")
            self._buckets[tenant] = (tokens - 1.0, now)


@dataclass
class _Held:
    """One tenant's live snapshots: key -> (bytes, expiry), and the expiries in a heap."""

    live: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    expiries: list[tuple[float, bytes]] = field(default_factory=list)
    total: int = 0


class SwaLedger:
    """Live SWA snapshot bytes per tenant, each with its expiry.

    Args:
        clock: its monotonic face measures TTLs.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def _current(self, tenant: str) -> _Held:
        """`tenant`'s entry with the expired snapshots taken off (lock held)."""
        held = self._held.setdefault(tenant, _Held())
        now = self.clock.monotonic()
        while held.expiries and held.expiries[0][0] <= now:
            expiry, key = heapq.heappop(held.expiries)
            entry = held.live.get(key)
            if entry is not None and entry[1] == expiry:  # not re-put since
                del held.live[key]
                held.total -= entry[0]
        return held

    def live_bytes(self, tenant: str) -> int:
        """Bytes of `tenant`'s snapshots still within their TTL."""
        with self._lock:
            return self._current(tenant).total

    def reserve(self, tenant: str, sizes: dict[bytes, int], ttl_s: float,
                quota_bytes: int) -> dict[bytes, tuple[int, float] | None]:
        """Charge snapshots (key -> bytes) living `ttl_s` to `tenant`; what they replaced.

        A key already held is replaced, not counted twice.

        Raises:
            QuotaExceeded: the tenant's live bytes would pass `quota_bytes` (0: unlimited); nothing is charged.
        """
        with self._lock:
            held = self._current(tenant)
            previous = {key: held.live.get(key) for key in sizes}
            after = held.total + sum(sizes.values()) - sum(p[0] for p in previous.values() if p)
            if quota_bytes and after > quota_bytes:
                raise QuotaExceeded(
                    f"tenant {tenant!r} is over its swa_quota_bytes quota of {quota_bytes} bytes: it holds "
                    f"{held.total} bytes of live snapshots and this Put adds {sum(sizes.values())}",
                    hint="let snapshots expire or delete them, or ask an admin to raise the quota")
            expiry = self.clock.monotonic() + ttl_s
            for key, size in sizes.items():
                self._put(held, key, (size, expiry))
            return previous

    def release(self, tenant: str, previous: dict[bytes, tuple[int, float] | None]) -> None:
        """Undo a `reserve` whose Put stored nothing: each key back to what it was."""
        with self._lock:
            held = self._current(tenant)
            for key, entry in previous.items():
                self._put(held, key, entry)

    def forget(self, tenant: str, keys: list[bytes]) -> None:
        """Take deleted snapshots off the ledger."""
        with self._lock:
            held = self._current(tenant)
            for key in keys:
                self._put(held, key, None)

    @staticmethod
    def _put(held: _Held, key: bytes, entry: tuple[int, float] | None) -> None:
        old = held.live.pop(key, None)
        held.total -= old[0] if old else 0
        if entry is not None:
            held.live[key] = entry
            held.total += entry[0]
            heapq.heappush(held.expiries, (entry[1], key))


class QuotaInterceptor(grpc.aio.ServerInterceptor):
    """Applies the request rate to every data RPC and the SWA TTL and byte quota to SwaPool.Put.

    Args:
        policies: the tenants' policies.
        swa_ttl_s: the server's SWA TTL (a Put without ttl_ms lives this long).
        clock: time for buckets and TTLs.
    """

    def __init__(self, policies: PolicyTable, *, swa_ttl_s: float, clock: Clock | None = None) -> None:
        clock = clock or SystemClock()
        self.policies = policies
        self.swa_ttl_s = swa_ttl_s
        self.rate = RequestRate(policies, clock)
        self.ledger = SwaLedger(clock)
        self._handlers: dict[str, Handler] = {}

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        handler = await continuation(handler_call_details)
        if handler is None or method.split("/")[1] not in DATA_SERVICES:
            return handler
        if method not in self._handlers:
            self._handlers[method] = self._wrap(method, handler)
        return self._handlers[method]

    def _wrap(self, method: str, handler: Handler) -> Handler:
        """`handler` with its behavior behind the checks; other handler kinds keep theirs."""
        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler))
        for kind, make in kinds:
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrapped = self._guard(method, behavior, unary_request=kind.startswith("unary"))
                if wrapped is None:
                    return handler
                return make(wrapped, request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    def _guard(self, method: str, behavior: Any, *, unary_request: bool) -> Any:
        swa = unary_request and method in (SWA_PUT, SWA_DELETE)
        if inspect.iscoroutinefunction(behavior):
            async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await self._admit(context)
                if swa:
                    return await self._swa_call(method, behavior, request, context)
                return await behavior(request, context)
            return checked
        if inspect.isasyncgenfunction(behavior):
            async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await self._admit(context)
                async for reply in behavior(request, context):
                    yield reply
            return checked_stream
        return None  # a sync behavior: none on this server

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self.rate.take(current_caller().tenant)
        except KVStoreError as exc:
            await _abort(context, exc)

    def _swa_tenant(self, requested: str) -> str | None:
        """Whose SWA quota a call names: the caller's own, or, for an admin, the namespace named.

        None when the call names another tenant's namespace without the right to: the
        servicer refuses it (PERMISSION_DENIED), and this must not tell it anything first.
        """
        try:
            return checked_namespace(requested)  # the caller's tenant for '', refuses others but to admins
        except KVStoreError:
            return None  # the servicer names what is wrong

    async def _swa_call(self, method: str, behavior: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tenant = self._swa_tenant(request.namespace)
        if tenant is None:
            return await behavior(request, context)
        geo = (request.geometry or geometry.V4_1_FLASH.name).encode() + b"\0"
        if method == SWA_DELETE:
            reply = await behavior(request, context)
            self.ledger.forget(tenant, [geo + k for k in request.keys])
            return reply
        policy = self.policies.policy(tenant)
        ttl_s = min(request.ttl_ms / 1000.0 if request.ttl_ms else self.swa_ttl_s, self.swa_ttl_s)
        if policy.swa_ttl_s < ttl_s:
            ttl_s = policy.swa_ttl_s
            request.ttl_ms = max(1, int(ttl_s * 1000))
        sizes: dict[bytes, int] = {}
        for snap in request.snapshots:
            sizes[geo + snap.key] = len(snap.data)
        try:
            previous = self.ledger.reserve(tenant, sizes, ttl_s, policy.swa_quota_bytes)
        except KVStoreError as exc:
            await _abort(context, exc)
        try:
            reply = await behavior(request, context)
        except BaseException:
            self.ledger.release(tenant, previous)
            raise
        if not reply.stored:
            self.ledger.release(tenant, previous)
        return reply


async def _abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> None:
    note_error(exc)  # the refusal's class, for the metrics and the failed-request log (gateway.call_outcome)
    await context.abort(to_status(exc), f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
