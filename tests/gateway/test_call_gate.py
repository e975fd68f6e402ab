"""The call gate on a real grpc.aio server on loopback: each registered method gated once, at registration,
its calls told once each (OK, refused undecodable, its errors), and a handler an inner interceptor put in its
place (auth's refusal) still told."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.call_gate import CallGate
from gateway.call_outcome import CallOutcome
from gateway.status import unary

#: Not a protobuf message of any type: a field tag whose varint never ends.
GARBAGE = b"\xff\xff\xff"
SERVICE = "test.Gated"
REQUEST = health_pb2.HealthCheckRequest
REPLY = health_pb2.HealthCheckResponse


class _Servicer:
    @unary
    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.service == "missing":
            from kvstore.errors import NotFound

            raise NotFound("no such service")
        return REPLY(status=REPLY.SERVING)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        for _ in range(2):
            yield REPLY(status=REPLY.SERVING)


def _handlers(servicer: _Servicer) -> dict[str, Any]:
    kw = {"request_deserializer": REQUEST.FromString, "response_serializer": REPLY.SerializeToString}
    return {"Check": grpc.unary_unary_rpc_method_handler(servicer.Check, **kw),
            "Watch": grpc.unary_stream_rpc_method_handler(servicer.Watch, **kw),
            "Stream": grpc.unary_stream_rpc_method_handler(servicer.Watch, **kw)}


class _DenyWatch(grpc.aio.ServerInterceptor):
    """Answers Watch with a refusal of its own, as the auth interceptor does for a missing right."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler_call_details.method != f"/{SERVICE}/Watch":  # type: ignore[attr-defined]
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
            yield  # pragma: no cover - abort raises

        return grpc.unary_stream_rpc_method_handler(deny, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


@pytest.fixture
def gated(loop_thread: Any) -> Iterator[tuple[CallGate, list[CallOutcome], grpc.Channel, dict[str, Any]]]:
    """A server whose one service was registered through the gate, `_DenyWatch` inside it."""
    seen: list[CallOutcome] = []
    gate = CallGate([seen.append])
    raw = _handlers(_Servicer())

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=[gate, _DenyWatch()])
        registrar = gate.registrar(server)
        registrar.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, raw),))
        registrar.add_registered_method_handlers(SERVICE, raw)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gate, seen, channel, raw
    finally:
        loop_thread.run(server.stop(0))


def test_a_registered_method_is_gated_once_and_each_call_told_once(gated: Any) -> None:
    gate, seen, channel, raw = gated
    check = channel.unary_unary(f"/{SERVICE}/Check")
    for _ in range(3):
        assert check(REQUEST(service="x").SerializeToString(), timeout=20) == REPLY(
            status=REPLY.SERVING).SerializeToString()
    assert len(list(channel.unary_stream(f"/{SERVICE}/Stream")(REQUEST().SerializeToString(), timeout=20))) == 2
    assert [(o.method, o.code) for o in seen] == [(f"{SERVICE}/Check", grpc.StatusCode.OK)] * 3 + [
        (f"{SERVICE}/Stream", grpc.StatusCode.OK)]
    # Built once, at registration: the same gated handler every time, none made per call.
    assert gate.gated(f"/{SERVICE}/Check", raw["Check"]) is gate.gated(f"/{SERVICE}/Check", raw["Check"])
    assert gate._handlers == {}  # the outcome interceptor wrapped nothing itself: the gated handler tells


def test_undecodable_requests_and_errors_are_refused_and_told(gated: Any) -> None:
    _, seen, channel, _ = gated
    check = channel.unary_unary(f"/{SERVICE}/Check")
    with pytest.raises(grpc.RpcError) as bad:
        check(GARBAGE, timeout=20)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "could not be decoded" in bad.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        check(REQUEST(service="missing").SerializeToString(), timeout=20)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert [(o.code, o.reason) for o in seen] == [(grpc.StatusCode.INVALID_ARGUMENT, ""),
                                                   (grpc.StatusCode.NOT_FOUND, "NotFound")]
    assert "could not be decoded" in seen[0].message and seen[1].message.startswith("no such service")


def test_a_handler_put_in_the_registered_ones_place_is_told(gated: Any) -> None:
    _, seen, channel, _ = gated
    with pytest.raises(grpc.RpcError) as denied:
        list(channel.unary_stream(f"/{SERVICE}/Watch")(REQUEST().SerializeToString(), timeout=20))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [(o.method, o.code, o.message) for o in seen] == [
        (f"{SERVICE}/Watch", grpc.StatusCode.PERMISSION_DENIED, "not yours")]
