"""The error hierarchy of kvstore, and the one table that maps it to gRPC status.

Every error carries whether a retry can help and a hint for the caller. The
server turns an error into a status with `to_status`; the client turns a status
back into the same class with `from_status`, so both ends speak one vocabulary.

A hint must be true of the call that raised it. A class's default hint is
written for the store's data calls (a refused Put stored nothing; a damaged
block was dropped); a call it does not fit gives its own (`hint=`), and an
entry point that knows better replaces a default one (`has_default_hint`): the
CLI gives each command its own, the Admin service each call. An error rebuilt
from a status takes no default: the server already put its hint in the message.
"""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    """Root of every error kvstore raises on purpose.

    Attributes:
        retryable: whether the same call may succeed later unchanged.
        hint: what the caller can do about it.
    """

    retryable: bool = False
    hint: str = ""

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        if hint:
            self.hint = hint


class InvalidArgument(KVStoreError):
    """The request is malformed: wrong size, unknown geometry, bad hash, bad batch."""

    hint = "fix the request; nothing was stored"


class NotFound(KVStoreError):
    """A named thing (lease, region, snapshot) does not exist."""


class FailedPrecondition(KVStoreError):
    """The request is well formed but the store is not in a state to take it."""


class ResourceExhausted(KVStoreError):
    """No room: the store is full of blocks still under their retention guarantee, or a limit was reached."""

    retryable = True
    hint = ("raise store.capacity_bytes (with the disk space for it), release leases you hold, "
            "or retry once stored blocks pass their retention")


class StoreFull(ResourceExhausted):
    """The store has no room without evicting a block inside its retention window or leased.

    Retention is a floor the operator promised, so the hint names what can be done
    instead: more capacity, fewer leases, or waiting until the soonest block may go.

    Args:
        message: what was asked and what is free.
        soonest_evictable_s: seconds until the first unleased block passes its
            retention (None when unknown or when every block is leased).
    """

    def __init__(self, message: str, *, soonest_evictable_s: float | None = None) -> None:
        if soonest_evictable_s is None:
            wait = "retry once stored blocks pass their retention"
        else:
            hours = max(soonest_evictable_s, 0.0) / 3600.0
            wait = f"retry in {hours:.1f} h, when the first stored block passes its retention"
        super().__init__(message, hint=("raise store.capacity_bytes (with the disk space for it), "
                                        f"release leases you hold, or {wait}"))


class Unauthenticated(KVStoreError):
    """No valid credentials were presented."""


class PermissionDenied(KVStoreError):
    """The caller may not touch this tenant or region."""


class Unavailable(KVStoreError):
    """The service or a backend cannot be reached now."""

    retryable = True
    hint = "retry with backoff"


class DeadlineExceeded(KVStoreError):
    """The call ran out of time."""

    retryable = True


class Internal(KVStoreError):
    """A bug or an unexpected failure inside the service."""


class DataLoss(KVStoreError):
    """Stored data was found damaged (a bad page or checksum); what it held was dropped, not returned."""

    hint = "the damaged blocks were dropped: recompute them and put them again; run `kvstore check` on the data dir"


class ConfigError(KVStoreError):
    """A configuration value is missing or out of range (raised at start-up)."""


class PutNotReplicated(KVStoreError):
    """A fleet Put stopped part-way: some copy of a run was not made durable (docs/FLEET.md, "Data path").

    The first `stored_blocks` blocks of the Put are durable on every replica of their
    runs; nothing after them is acknowledged (a copy may be on some replicas: blocks
    never change, so putting the same blocks again is safe and completes it).

    Args:
        message: which runs failed on which nodes, and why.
        stored_blocks: blocks of this Put, from its first, stored on all their replicas.
        failures: (run index, node id, the error that node's Put raised), one per failed copy.
    """

    def __init__(self, message: str, *, stored_blocks: int,
                 failures: tuple[tuple[int, str, KVStoreError], ...]) -> None:
        super().__init__(message, hint="put the same blocks again (stored ones are kept, not rewritten); "
                                       "a dead node leaves the placement when its lease ends")
        self.stored_blocks = stored_blocks
        self.failures = failures
        #: Retryable when every failed copy's error was (a node away, say; not a refused block).
        self.retryable = bool(failures) and all(e.retryable for _, _, e in failures)


STATUS_CODES: dict[type[KVStoreError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Internal: grpc.StatusCode.INTERNAL,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    ConfigError: grpc.StatusCode.FAILED_PRECONDITION,
}

_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {}
for _cls, _code in STATUS_CODES.items():
    _BY_CODE.setdefault(_code, _cls)


def to_status(error: KVStoreError) -> grpc.StatusCode:
    """The gRPC status code for `error` (its nearest mapped ancestor)."""
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


def has_default_hint(error: KVStoreError) -> bool:
    """Whether `error` carries only its class's default hint: none was given where it was raised."""
    return "hint" not in vars(error)


def from_status(code: grpc.StatusCode, message: str) -> KVStoreError:
    """The kvstore error a client raises for a gRPC status `code`.

    Its hint is the one the server appended to `message`, never the class's default: that
    was written for other calls (a damaged export file is not a dropped block). Only
    Unavailable keeps its default ("retry with backoff", true of any call) when the
    message lacks it, as it does when the transport itself failed.
    """
    cls = _BY_CODE.get(code, Internal)
    error = cls(message or code.name)
    if not (cls is Unavailable and not error.message.endswith(f"({cls.hint})")):
        error.hint = ""
    return error
