"""Unary calls sent from the calling thread and waited on afterwards (kvstore/client/started_calls.py): a real
gRPC server on loopback whose handler says when a request has arrived and answers when the test lets it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
import pytest

from kvstore.client import started_calls

WAIT_S = 30.0


@dataclass
class Echo:
    """The server's side: each request's arrival is set in `arrived`; it is answered once `go` is set."""

    arrived: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.arrived.set()
        if request == b"refuse":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        self.go.wait(WAIT_S)
        return b"echo:" + request


@pytest.fixture()
def served() -> Iterator[tuple[Echo, grpc.Channel]]:
    echo = Echo()
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Unary": grpc.unary_unary_rpc_method_handler(echo.unary)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield echo, channel
    finally:
        echo.go.set()
        channel.close()
        server.stop(None)


def unary(channel: grpc.Channel) -> Any:
    return channel.unary_unary("/test.Echo/Unary")


def test_grpcs_own_unary_calls_are_started_on_this_thread(served: tuple[Echo, grpc.Channel]) -> None:
    """The fast path is taken for a channel's own multicallable (else every call would silently go to the pool);
    a stand-in of a test's or an interceptor's is pooled."""
    _, channel = served
    assert started_calls.startable(unary(channel))
    assert not started_calls.startable(lambda request, **kwargs: request)


@pytest.mark.parametrize("how", ["started", "pooled"])
def test_a_started_call_is_sent_before_its_wait_and_answers_as_the_blocking_call(
        served: tuple[Echo, grpc.Channel], how: str) -> None:
    """The request is on the server before the caller waits (the caller's work meanwhile overlaps it); the wait
    gives the reply the blocking call would, and its errors: the server's status, the deadline's."""
    echo, channel = served
    call = unary(channel)
    if how == "pooled":
        call = (lambda c: lambda request, **kwargs: c(request, **kwargs))(call)
    wait = started_calls.start(call, b"x", timeout=WAIT_S)
    assert echo.arrived.wait(WAIT_S)  # arrived while no one waits on the call
    echo.go.set()
    assert wait() == b"echo:x"
    with pytest.raises(grpc.RpcError) as refused:
        started_calls.start(call, b"refuse", timeout=WAIT_S)()
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    echo.go.clear()
    with pytest.raises(grpc.RpcError) as late:
        started_calls.start(call, b"wait", timeout=0.2)()
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_at_once_waits_on_every_call_even_when_the_work_meanwhile_raises(served: tuple[Echo, grpc.Channel]) -> None:
    """Every call started is waited on, its outcome given back with what the work meanwhile raised, so the caller
    can undo what the calls did (a fleet Lookup releases their leases)."""
    echo, channel = served
    call = unary(channel)

    def meanwhile() -> None:
        assert echo.arrived.wait(WAIT_S)
        echo.go.set()
        raise ValueError("bad argument")

    starts = [partial(started_calls.start, call, r, timeout=WAIT_S) for r in (b"a", b"b", b"c")]
    outcomes, failed = started_calls.at_once(starts, meanwhile)
    assert outcomes == [b"echo:a", b"echo:b", b"echo:c"]
    assert isinstance(failed, ValueError)


def test_a_grpc_whose_parts_take_other_arguments_sends_by_the_pool(
        served: tuple[Echo, grpc.Channel], monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer grpc whose private call parts changed their arguments still gets its reply (the blocking call on
    the pool), not a TypeError from inside grpc."""
    echo, channel = served
    call = unary(channel)

    def changed(*args: Any) -> Any:
        raise TypeError("_prepare() takes 2 positional arguments but 6 were given")

    monkeypatch.setattr(started_calls, "_begin", changed)
    echo.go.set()
    assert started_calls.start(call, b"y", timeout=WAIT_S)() == b"echo:y"
