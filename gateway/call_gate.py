"""`kvstore serve`'s per-call checks in one wrapper per method, built when the method is registered.

Three of the server's checks used to be three interceptors, each a coroutine per
call in grpc.aio's chain and a layer of wrapper per call around the method: the
call's outcome (gateway.call_outcome), its undecodable request
(gateway.undecodable) and its tenant's quota (gateway.quotas). Under load the
server is bound by its event loop, where all of them run. `CallGate` keeps
what each does and the order they did it in, in one frame per call:

1. the call's outcome is told to the observers once, before its status leaves
   (an abort is seen through the observed context, as before);
2. an undecodable request is refused INVALID_ARGUMENT before anything else
   runs (it decodes leniently: gateway.undecodable's deserializer);
3. a data RPC (`quotas.DATA_SERVICES`) takes one request from the caller's
   bucket, or is refused RESOURCE_EXHAUSTED; SwaPool.Put and Delete go through
   the SWA ledger (gateway.quotas);
4. then the method, whose errors gateway.status maps to status codes.

The wrapping is built once per method, when a service is added to the server
through `CallGate.registrar` (server start), not per call. One interceptor stays,
outermost, for what only an interceptor sees: a call that the auth interceptor
inside it answers with a refusal of its own (a handler other than the registered
one) is observed there, as gateway.call_outcome always did; the registered
method's gated handler passes it untouched. Request streams and sync methods
(none in the hot path) get the three wrappers of the modules themselves,
composed once in the same order.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from gateway.call_outcome import Behavior, Handler, Observer, OutcomeInterceptor, _Call, _ObservedContext
from gateway.quotas import SWA_DELETE, SWA_PUT, QuotaInterceptor, quota_abort
from gateway.undecodable import Undecodable, guard, lenient, refuse
from kvstore.errors import KVStoreError


class CallGate(OutcomeInterceptor):
    """Outcomes, undecodable requests and quotas for every method registered through `registrar`.

    Args:
        observers: called with each call's `CallOutcome` (gateway.call_outcome).
        quotas: the tenants' request rate and SWA ledger; None charges nothing (set it before any
            service is registered).
    """

    def __init__(self, observers: Sequence[Observer], quotas: QuotaInterceptor | None = None) -> None:
        super().__init__(observers)
        self.quotas = quotas
        #: method full name -> (the handler registered, its gated one)
        self._gated: dict[str, tuple[Handler, Handler]] = {}

    def registrar(self, server: grpc.aio.Server) -> grpc.aio.Server:
        """`server` as the services' `add_*` functions see it: every handler they add is gated."""
        return _GatedServer(server, self)

    def gated(self, method: str, handler: Handler) -> Handler:
        """The gated handler of `handler`, registered for `method` ("/package.Service/Method"); built once."""
        known = self._gated.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        built = self._build(method, handler)
        self._gated[method] = (handler, built)
        return built

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: not counted (a client could grow the label set without end)
            return None
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        known = self._gated.get(method)
        if known is not None and known[1] is handler:  # the registered method: it observes itself
            return handler
        return self.observed_handler(method, handler)  # auth's refusal, or a method registered around the gate

    def _build(self, method: str, handler: Handler) -> Handler:
        quotas = self.quotas if self.quotas is not None and self.quotas.charges(method) else None
        decode = lenient(handler.request_deserializer)
        serialize = handler.response_serializer
        name = method.lstrip("/")
        unary, streaming = handler.unary_unary, handler.unary_stream
        if unary is not None and inspect.iscoroutinefunction(unary):
            return grpc.unary_unary_rpc_method_handler(self._gated_unary(name, method, unary, quotas),
                                                       request_deserializer=decode, response_serializer=serialize)
        if streaming is not None and inspect.isasyncgenfunction(streaming):
            return grpc.unary_stream_rpc_method_handler(self._gated_streaming(name, method, streaming, quotas),
                                                        request_deserializer=decode, response_serializer=serialize)
        # The other shapes, as the three interceptors nested them (outcome outside, quotas inside).
        inner = quotas.wrap(method, handler) if quotas is not None else handler
        return self.wrap(name, guard(method, inner))

    def _gated_unary(self, name: str, method: str, behavior: Behavior, quotas: QuotaInterceptor | None) -> Behavior:
        rate = quotas.rate if quotas is not None else None
        swa = quotas if quotas is not None and method in (SWA_PUT, SWA_DELETE) else None

        async def gated(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self, name)
            observed = _ObservedContext(call, context)
            try:
                if request.__class__ is Undecodable:
                    await refuse(method, request, observed)
                if rate is not None:
                    try:
                        rate.take(call.tenant)  # the caller auth set, read once by the call's record
                    except KVStoreError as exc:
                        await quota_abort(observed, exc)
                if swa is not None:
                    response = await swa.swa_call(method, behavior, request, observed)
                else:
                    response = await behavior(request, observed)
            except BaseException as exc:
                call.finish(context, exc)
                raise
            call.finish(context, None)
            return response
        return gated

    def _gated_streaming(self, name: str, method: str, behavior: Behavior, quotas: QuotaInterceptor | None) -> Behavior:
        rate = quotas.rate if quotas is not None else None

        async def gated(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self, name)
            observed = _ObservedContext(call, context)
            try:
                if request.__class__ is Undecodable:
                    await refuse(method, request, observed)
                if rate is not None:
                    try:
                        rate.take(call.tenant)
                    except KVStoreError as exc:
                        await quota_abort(observed, exc)
                async for response in behavior(request, observed):
                    yield response
            except BaseException as exc:
                call.finish(context, exc)
                raise
            call.finish(context, None)
        return gated


class _GatedGeneric(grpc.GenericRpcHandler):
    """A service's generic handler whose methods answer through the gate."""

    def __init__(self, inner: grpc.GenericRpcHandler, gate: CallGate) -> None:
        self._inner = inner
        self._gate = gate

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return self._gate.gated(handler_call_details.method, handler)  # type: ignore[attr-defined]


class _GatedServer(grpc.aio.Server):
    """Stands in for the server while services are added: what they register goes through the gate.

    A grpc.aio.Server itself, since some `add_*` functions pick their servicer by that (server reflection's
    `enable_server_reflection` serves its sync one, which no wrapper can guard, to anything else).
    """

    def __init__(self, server: grpc.aio.Server, gate: CallGate) -> None:
        self._server = server
        self._gate = gate

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """The server's, each handler gated."""
        self._server.add_generic_rpc_handlers(tuple(_GatedGeneric(h, self._gate) for h in generic_rpc_handlers))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Handler]) -> None:
        """The server's, each method's handler gated (the same gated handler as its generic one)."""
        self._server.add_registered_method_handlers(
            service_name, {name: self._gate.gated(f"/{service_name}/{name}", h) for name, h in method_handlers.items()})

    def add_insecure_port(self, address: str) -> int:
        """The server's."""
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        """The server's."""
        return self._server.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        """The server's."""
        await self._server.start()

    async def stop(self, grace: float | None) -> None:
        """The server's."""
        await self._server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        """The server's."""
        return await self._server.wait_for_termination(timeout)
