"""Turns kvstore errors into gRPC status at the servicer edge, in one place.

Servicer methods are wrapped by `unary` or `streaming`; a KVStoreError becomes
the status that `kvstore.errors.to_status` names, with its message. Anything
else is a bug: it is logged and answered INTERNAL without leaking internals.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gateway.call_outcome import note_error
from kvstore.errors import KVStoreError, to_status

log = logging.getLogger("kvstore.gateway")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _message(error: KVStoreError) -> str:
    return f"{error.message} ({error.hint})" if error.hint else error.message


def unary(fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
          ) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Wrap a unary servicer method so errors become gRPC status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await fn(self, request, context)
        except KVStoreError as exc:
            note_error(exc)
            await context.abort(to_status(exc), _message(exc))
        except Exception as exc:
            note_error(exc)
            log.exception("unexpected error in %s", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}")
        raise AssertionError("unreachable")  # abort always raises

    return wrapper


def streaming(fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]
              ) -> Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    """Wrap a server-streaming servicer method so errors become gRPC status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            async for item in fn(self, request, context):
                yield item
        except KVStoreError as exc:
            note_error(exc)
            await context.abort(to_status(exc), _message(exc))
        except Exception as exc:
            note_error(exc)
            log.exception("unexpected error in %s", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}")

    return wrapper
