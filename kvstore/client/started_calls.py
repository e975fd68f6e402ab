"""Unary calls sent from the calling thread, their replies waited on afterwards: a round of calls to several nodes.

A blocking unary call sends its request and waits for its reply in one go, so calls to several nodes at once each
took a thread of a pool (a hand-off there and one back), and the caller could do no work of its own while they
flew. `start` sends the request now, on this thread, and returns the wait for its reply: a round starts every call,
does its own work meanwhile (a fleet Lookup's check of its hashes, docs/FLEET.md F83), then waits on each in turn
(all are in flight: waiting on one holds none of the others).

It runs grpc's blocking unary call in its two halves (`grpc._channel._UnaryUnaryMultiCallable._blocking`: the
request prepared and the call begun; then its one event waited on and the reply or error taken as `__call__`
does), so a call started so behaves as the blocking call: its reply, or the `grpc.RpcError` it would raise, at
its deadline at the latest. A multicallable that is not grpc's own (an intercepted channel, a test's stand-in), or
a grpc whose parts are not those (missing, or taking other arguments: a newer grpc), is called blocking on a
shared pool of threads instead (`pooled`), waited on the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

try:  # grpc's blocking unary call, in parts (see the docstring); absent: every call goes to the pool
    from grpc import _channel as _grpc_channel
except ImportError:  # pragma: no cover - a grpc without the module
    _grpc_channel = None  # type: ignore[assignment]

T = TypeVar("T")

#: Threads that blocking calls not started here wait on (shared by the process; made as needed).
POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="started-calls")

_CALLABLE_PARTS = ("_prepare", "_channel", "_method", "_target", "_context", "_registered_call_handle",
                   "_response_deserializer")
_MODULE_PARTS = ("cygrpc", "_common", "_determine_deadline", "_handle_event", "_end_unary_response_blocking")
#: grpc's own unary multicallable, when its parts are those this module uses; else None (every call pooled).
_NATIVE: type | None = None
if _grpc_channel is not None and all(hasattr(_grpc_channel, p) for p in (*_MODULE_PARTS, "_UnaryUnaryMultiCallable")):
    _NATIVE = _grpc_channel._UnaryUnaryMultiCallable

Wait = Callable[[], Any]


def startable(multicallable: Any) -> bool:
    """Whether `start` sends `multicallable`'s requests from the calling thread (else it pools them)."""
    return _NATIVE is not None and type(multicallable) is _NATIVE \
        and all(hasattr(multicallable, p) for p in _CALLABLE_PARTS)


def start(multicallable: Any, request: Any, *, timeout: float | None, metadata: Any = None) -> Wait:
    """Send `request` now and return the wait for its reply: the reply, or the `grpc.RpcError` the blocking
    call would raise (also one the request's serialisation raised here)."""
    if not startable(multicallable):
        return pooled(multicallable, request, timeout=timeout, metadata=metadata)
    try:  # grpc's private parts changed shape (a newer grpc): nothing was sent yet, so the pool sends it
        begun = _begin(multicallable, request, timeout, metadata)
    except (AttributeError, TypeError, ValueError):
        return pooled(multicallable, request, timeout=timeout, metadata=metadata)
    if isinstance(begun, grpc.RpcError):
        return _raises(begun)
    state, call = begun
    channel = _grpc_channel
    assert channel is not None

    def wait() -> Any:
        channel._handle_event(call.next_event(), state, multicallable._response_deserializer)
        return channel._end_unary_response_blocking(state, call, False, None)

    return wait


def _begin(multicallable: Any, request: Any, timeout: float | None, metadata: Any) -> Any:
    """grpc's blocking unary call up to its wait: (its state, the begun call), or the error that refused the
    request (its serialisation's, as `__call__` would raise it)."""
    channel = _grpc_channel
    assert channel is not None
    state, operations, deadline, refused = multicallable._prepare(request, timeout, metadata, None, None)
    if state is None:
        return refused if refused is not None else grpc.RpcError("the request could not be prepared")
    state.rpc_start_time = time.perf_counter()
    state.method = channel._common.decode(multicallable._method)
    state.target = channel._common.decode(multicallable._target)
    call = multicallable._channel.segregated_call(
        channel.cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, multicallable._method, None,
        channel._determine_deadline(deadline), metadata, None, ((operations, None),), multicallable._context,
        multicallable._registered_call_handle)
    return state, call


def pooled(multicallable: Any, request: Any, *, timeout: float | None, metadata: Any = None) -> Wait:
    """The blocking call on the shared pool, and the wait for its outcome (as `start`'s)."""
    return POOL.submit(multicallable, request, timeout=timeout, metadata=metadata).result


def _raises(error: grpc.RpcError | None) -> Wait:
    def wait() -> Any:
        raise error if error is not None else grpc.RpcError("the request could not be prepared")

    return wait


def at_once(starts: Sequence[Callable[[], Callable[[], T]]], meanwhile: Callable[[], object] | None = None
            ) -> tuple[list[T], BaseException | None]:
    """Each start called (its requests sent), then `meanwhile`, then each wait, in order: the outcomes, and what
    `meanwhile` raised (None: it returned). Every call is waited on either way, so none is left unanswered; the
    starts and waits must return their errors, not raise them."""
    waits = [s() for s in starts]
    failed: BaseException | None = None
    if meanwhile is not None:
        try:
            meanwhile()
        except Exception as exc:  # the caller decides, once every call has answered (e.g. releases their leases)
            failed = exc
    return [w() for w in waits], failed
