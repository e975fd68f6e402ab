"""What became of each RPC (method, tenant, status, message, duration), told to observers.

`OutcomeInterceptor` wraps every method the server serves and hands one
`CallOutcome` per finished call to its observers (the Prometheus series of
gateway.metrics, the failed-request log of gateway.request_log). It costs two
clock reads and a few attribute reads per call; anything heavier (the caller's
metadata, redaction) is left to observers, and only for failed calls. A call
is told before its status leaves the server: a client that saw its answer
finds it counted.

The tenant is the caller's (`gateway.auth.current_caller()`): the auth
interceptor sets it before any method runs, inside or outside this one, so the
order of the two does not matter for it. A call refused UNAUTHENTICATED is
tenant "unauthenticated" (nobody said who called). Which error class refused a
call reaches the observers as `reason`: gateway.status notes it (`note_error`)
on the same task before the error becomes a status.

A sync method (only the health service's List) runs on grpc's threads, which
do not carry the call's context: its tenant reads as the default one.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.auth import current_caller

#: grpc.RpcMethodHandler (grpc ships no type hints for it).
Handler = Any
Behavior = Callable[..., Any]
Observer = Callable[["CallOutcome"], None]

#: The tenant of a call refused before anyone said who the caller is.
UNAUTHENTICATED_TENANT = "unauthenticated"
#: Handler attributes by kind, and grpc's constructor of each.
_HANDLER_KINDS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)
_error_class: ContextVar[str] = ContextVar("kvstore_call_error_class", default="")


def note_error(exc: BaseException) -> None:
    """Remember, for this call's outcome, the class of the error that refused it (gateway.status calls it).

    An error with a `limit` attribute (a quota's setting name, from a fixed set: it becomes a label)
    is noted as "Class:limit", so rejections tell which limit was reached.
    """
    limit = getattr(exc, "limit", None)
    name = type(exc).__name__
    _error_class.set(f"{name}:{limit}" if isinstance(limit, str) and limit else name)


@dataclass(frozen=True, kw_only=True, slots=True)
class CallOutcome:
    """One finished call.

    Attributes:
        method: the full method name without its leading slash ("kvstore.v1.KVStore/Get").
        tenant: who called (see the module docstring for where it comes from).
        code: the status the call ended with.
        message: the status details ("" when OK).
        reason: the error class that refused it ("" when OK or when the status was set directly).
        duration_s: from the method's start to its last message.
        context: the call's servicer context (for observers that need the peer or the metadata).
    """

    method: str
    tenant: str
    code: grpc.StatusCode
    message: str
    reason: str
    duration_s: float
    context: Any


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _code(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    """The status the call ends with: the one set on the context, else what the exception means."""
    read = getattr(context, "code", None)  # a sync method's context has none
    code = read() if read is not None else None
    if isinstance(code, int):  # some grpc versions report the number
        code = _CODES.get(code)
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc answers for an exception escaping a method


def _details(context: Any) -> str:
    read = getattr(context, "details", None)
    details = read() if read is not None else ""
    if isinstance(details, bytes):
        return details.decode("utf-8", "replace")
    return details or ""


class _Call:
    """The bookkeeping of one call in flight."""

    __slots__ = ("done", "interceptor", "method", "start", "tenant")

    def __init__(self, interceptor: OutcomeInterceptor, method: str) -> None:
        self.interceptor = interceptor
        self.method = method
        self.tenant = current_caller().tenant
        self.done = False
        self.start = time.perf_counter()
        _error_class.set("")

    def finish(self, context: Any, exc: BaseException | None, aborted: tuple[grpc.StatusCode, str] | None = None,
               ) -> None:
        """Tell the observers, once: how the call ended (`aborted`: the status an abort is about to send)."""
        if self.done:
            return
        self.done = True
        duration = time.perf_counter() - self.start
        code, message = aborted if aborted is not None else (_code(context, exc), "")
        tenant = UNAUTHENTICATED_TENANT if code is grpc.StatusCode.UNAUTHENTICATED else self.tenant
        ok = code is grpc.StatusCode.OK
        outcome = CallOutcome(method=self.method, tenant=tenant, code=code,
                              message="" if ok else message or _details(context),
                              reason="" if ok else _error_class.get(), duration_s=duration, context=context)
        for observe in self.interceptor.observers:
            observe(outcome)


class _ObservedContext:
    """The servicer context a wrapped method sees: `abort` tells the outcome before the status goes out
    (grpc.aio sends it inside abort), so a client that saw the status also finds its call counted."""

    __slots__ = ("_call", "_context")

    def __init__(self, call: _Call, context: Any) -> None:
        self._call = call
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any) -> None:
        self._call.finish(self._context, None, (code, details))
        await self._context.abort(code, details, *args, **kwargs)


class _ObservedSyncContext(_ObservedContext):
    """`_ObservedContext` for a sync method, whose context's abort raises at once."""

    __slots__ = ()

    def abort(self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._call.finish(self._context, None, (code, details))
        return self._context.abort(code, details, *args, **kwargs)


class OutcomeInterceptor(grpc.aio.ServerInterceptor):
    """Tells `observers` how every call ended; a method's wrapping is reused while the interceptors inside
    this one hand back the same handler.

    Args:
        observers: called with each `CallOutcome` on the event loop (on grpc's threads for a sync method);
            they must be quick, thread-safe and must not raise.
    """

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        self._handlers: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        # Interceptors inside this one (auth) may answer each call with a handler of its own (a refusal):
        # always ask them, and reuse the wrapping only while they hand back the same handler.
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: not counted (a client could grow the label set without end)
            return None
        method = handler_call_details.method  # type: ignore[attr-defined]
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method.lstrip("/"), handler)
        self._handlers[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Handler) -> Handler:
        for kind, make in _HANDLER_KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(self._observed(method, behavior, streams=kind.endswith("_stream")),
                            request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    def _observed(self, method: str, behavior: Behavior, *, streams: bool) -> Behavior:
        """`behavior` telling its outcome; a sync one answering a stream (none on this server) is left alone."""
        if inspect.isasyncgenfunction(behavior):
            return self._streaming(method, behavior)
        if inspect.iscoroutinefunction(behavior):  # a coroutine may answer a stream with context.write
            return self._unary(method, behavior)
        if streams:
            return behavior
        return self._sync(method, behavior)

    def _sync(self, method: str, behavior: Behavior) -> Behavior:
        def observed(request: Any, context: Any) -> Any:  # runs on grpc's thread pool (the health service's List)
            call = _Call(self, method)
            try:
                response = behavior(request, _ObservedSyncContext(call, context))
            except BaseException as exc:
                call.finish(context, exc)
                raise
            call.finish(context, None)
            return response
        return observed

    def _unary(self, method: str, behavior: Behavior) -> Behavior:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self, method)
            try:
                response = await behavior(request, _ObservedContext(call, context))
            except BaseException as exc:
                call.finish(context, exc)
                raise
            call.finish(context, None)
            return response
        return observed

    def _streaming(self, method: str, behavior: Behavior) -> Behavior:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self, method)
            try:
                async for response in behavior(request, _ObservedContext(call, context)):
                    yield response
            except BaseException as exc:
                call.finish(context, exc)
                raise
            call.finish(context, None)
        return observed
