"""The gRPC server every kvstore process serves on (`kvstore serve`'s node and `kvstore gateway`): grpc.aio's
server with the message limit and no shared port, whose methods are all found through generic handlers.

Why no registered methods: grpc.aio's accept loop (`AioServer._server_main_loop`, grpcio 1.85) keeps one
pending request-call future per registered method, plus one for the generic handlers, and after every accepted
call runs `asyncio.wait` over all of them. That is O(methods) of event-loop work per call: about 70 us at a
node's ~48 methods against 12 us with one future (measured in process, 2,000 accepts each), and the loop is the
node's bound under load (docs/BENCHMARKS.md, `bench load`). Each method also has only one call accepted at a
time, so a burst of Lookups is taken one per loop round. The generated `add_*Servicer_to_server` functions
register every service both ways; here only the generic handlers are kept, which find the same handler for
every method (grpc looks the method up in each service's table), so nothing a client sees changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor], max_message_bytes: int) -> grpc.aio.Server:
    """A grpc.aio server taking messages up to `max_message_bytes` each way, its port its own (a second process
    binding it fails instead of sharing its calls), serving every method through its generic handlers."""
    server = grpc.aio.server(interceptors=list(interceptors), options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])
    # The instance's method, not the class's: setattr, as grpc.aio.Server declares it.
    setattr(server, "add_registered_method_handlers", _generic_only)  # noqa: B010
    return server


def _generic_only(service: str, handlers: dict[str, Any]) -> None:
    """Registered methods are not kept: the generic handlers registered beside them serve `service`'s calls."""
    del service, handlers
