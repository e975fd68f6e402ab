"""Requests that cannot be decoded answer INVALID_ARGUMENT, on every method of every service.

grpc.aio decodes a request with its method's deserializer before the servicer
runs. A DecodeError there escapes every servicer wrapper: it was answered
UNKNOWN with a traceback in the log, and inside a request stream it surfaced in
the servicer's own iteration (PutStream never answered). `UndecodableRequests`,
one server interceptor, gives every method a deserializer that turns a failure
into an `Undecodable` value, and wraps the method:

- one request: an `Undecodable` one is answered INVALID_ARGUMENT before the
  method runs;
- a request stream: its iterator raises `UndecodableRequest` (an
  InvalidArgument) at the bad message, so the servicer ends the call as it does
  for any bad request (PutStream commits what came before); if the error
  escapes the servicer, the wrapper answers INVALID_ARGUMENT itself.

Either way the call is one failed request in the server's request log
(gateway.request_log: one WARNING line, no traceback); the line written here
is DEBUG, so a bad message is not logged twice.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.errors import InvalidArgument

log = logging.getLogger("kvstore.gateway")

#: grpc.RpcMethodHandler (grpc ships no type hints for it).
Handler = Any
Behavior = Callable[..., Any]


@dataclass(frozen=True)
class Undecodable:
    """What a deserializer returns for bytes that are not a message of its type."""

    size_bytes: int
    reason: str


class UndecodableRequest(InvalidArgument):
    """A request message of a stream could not be decoded."""

    hint = "send messages serialized from the method's request type; the call ended at this one"


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # whatever the parser raises, the bytes are bad
            return Undecodable(size_bytes=len(raw), reason=str(exc) or type(exc).__name__)

    return decode


def _message(method: str, bad: Undecodable) -> str:
    return f"{method}: the request ({bad.size_bytes} bytes) could not be decoded: {bad.reason}"


def _refusal(method: str, bad: Undecodable, context: Any) -> UndecodableRequest:
    """The error refusing `bad`, its one log line written."""
    message = _message(method, bad)
    log.debug("refused from %s: %s", context.peer(), message)  # the request log has the WARNING line
    return UndecodableRequest(message)


def _refuse(method: str, bad: Undecodable, context: Any) -> Any:
    """Abort the call: awaitable on an async context, raising on a sync one."""
    return context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, bad, context).message)


def _guard_request(method: str, behavior: Behavior) -> Behavior:
    """`behavior` with an undecodable request refused before it runs."""
    if inspect.iscoroutinefunction(behavior):
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(method, request, context)
            return await behavior(request, context)
        return guarded
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(method, request, context)
            async for response in behavior(request, context):
                yield response
        return guarded_stream

    def guarded_sync(request: Any, context: Any) -> Any:  # run on a thread; abort raises there
        if isinstance(request, Undecodable):
            _refuse(method, request, context)
        return behavior(request, context)
    return guarded_sync


async def _checked(method: str, requests: AsyncIterator[Any],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise _refusal(method, request, context)
        yield request


def _answer(exc: UndecodableRequest, context: grpc.aio.ServicerContext) -> Awaitable[None]:
    return context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.message} ({exc.hint})")


def _guard_stream(method: str, behavior: Behavior) -> Behavior | None:
    """`behavior` reading a request stream that raises at an undecodable message (None: a sync one)."""
    if inspect.iscoroutinefunction(behavior):
        async def guarded(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(_checked(method, requests, context), context)
            except UndecodableRequest as exc:
                await _answer(exc, context)
        return guarded
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(requests: AsyncIterator[Any],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for response in behavior(_checked(method, requests, context), context):
                    yield response
            except UndecodableRequest as exc:
                await _answer(exc, context)
        return guarded_stream

    return None


def guard(method: str, handler: Handler) -> Handler:
    """`handler` with a deserializer that never raises and a behavior that refuses what it could not decode.

    A sync request-streaming behavior (none on this server) keeps grpc's own decoding.
    """
    decode = _lenient(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_guard_request(method, handler.unary_unary),
                                                   request_deserializer=decode, response_serializer=serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_guard_request(method, handler.unary_stream),
                                                    request_deserializer=decode, response_serializer=serialize)
    if handler.stream_unary is not None and (b := _guard_stream(method, handler.stream_unary)):
        return grpc.stream_unary_rpc_method_handler(b, request_deserializer=decode, response_serializer=serialize)
    if handler.stream_stream is not None and (b := _guard_stream(method, handler.stream_stream)):
        return grpc.stream_stream_rpc_method_handler(b, request_deserializer=decode, response_serializer=serialize)
    return handler


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """Guards every method the server serves (`guard`); each method's handler is built once."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if method in self._handlers:
            return self._handlers[method]
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown name is not kept: a client could grow the cache without end
            return None
        guarded = self._handlers[method] = guard(method, handler)
        return guarded
