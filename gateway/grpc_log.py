"""grpc.aio's ERROR for a reply the client did not wait for, told as one DEBUG line instead.

When a client cancels a call while the server sends its reply (it went away, its
deadline passed, or it refused the reply as larger than it accepts), the send
fails in gRPC's core. grpc.aio ignores that failure when it already knows the
client closed the call, but that news comes on a second completion of the core
that can be handled after the failed send's: grpc then logs "ExecuteBatchError
raised in core by servicer method [...]" at ERROR with a traceback of its own
internals, once per cancelled call. No servicer code can tell: the failed send is
grpc's (a unary handler has returned by then), and nothing is wrong with the
server, the peer ended the call. `quiet_cancelled_replies` turns exactly that
record into one DEBUG line on "kvstore.gateway" naming the method; every other
record of grpc's passes as it was. (The other way a send fails, a reply over the
server's own message limit, does not happen here: Get sends one stored block a
message, taken in under the same limit, and Fetch's replies are held under it by
`gateway.transfer_fetch.fetch_keys`; only a limit lowered below the size of blocks
stored before would.)
"""

from __future__ import annotations

import logging

#: The logger grpc.aio's server writes to (grpc/_cython/_cygrpc/aio/server.pyx.pxi).
GRPC_LOGGER = "grpc._cython.cygrpc"
#: The start of grpc's message for a failed send it did not yet know the client had cancelled.
_FAILED_SEND = "ExecuteBatchError raised in core by servicer method "

log = logging.getLogger("kvstore.gateway")


class CancelledReplyFilter(logging.Filter):
    """Drops grpc's ERROR for a send that failed under a cancelled call, writing one DEBUG line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        message = record.getMessage()
        if exc is None or exc.__name__ != "ExecuteBatchError" or not message.startswith(_FAILED_SEND):
            return True
        method = message[len(_FAILED_SEND):].strip("[]")
        log.debug("%s: the call ended before its reply went out (the client cancelled it or went away)", method)
        return False


_FILTER = CancelledReplyFilter()


def quiet_cancelled_replies() -> None:
    """Install the filter on grpc's server logger, once per process (`gateway.server.start` calls it)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
