"""The seams of the transfer client: a submitted batch (`Transfer`) and a way of
moving its bytes (`TransferPath`), with the batch run in this process (`LocalTransfer`).

`kvstore.client.transfer` holds the session, `kvstore.client.transfer_batches` its
batches, `kvstore.client.transfer_shm` the shared-memory path and
`kvstore.client.transfer_stream` the path across hosts.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import InvalidArgument
from kvstore.transfer import BatchResults, DescriptorGroup, TransferState

if TYPE_CHECKING:
    from kvstore.client.connection import Connection
    from kvstore.region import Region
    from kvstore.v1 import transfer_pb2 as pb


class SmallReads(Protocol):
    """A session's request ring as the shared-memory path sees it (`transfer_ring.RingClient`)."""

    max_descriptors: int

    def read(self, request: pb.SubmitRequest) -> pb.TransferState:
        """Serve one small Submit through the ring (raises `RingUnusable` when it cannot)."""
        ...


class SessionView(Protocol):
    """What the paths use of their session (`kvstore.client.transfer.TransferSession`).

    Written out so that the paths depend on this module, not on the session that builds
    them: the session imports every path, and no path imports the session.
    """

    connection: Connection
    stub: Any
    session_id: str
    streams: int
    max_descriptors: int
    keep_finished: int
    bulk_offered: list[str]
    bulk_reason: str

    @property
    def ring(self) -> SmallReads | None:
        """The session's request ring once registered (None: small reads go by Submit)."""
        ...

    def region(self, region_id: int) -> Region:
        """A region of this session by id (NotFound if it is not registered)."""
        ...

    def call(self, method: Any, request: Any) -> Any:
        """One unary call, its failure raised as a KVStoreError."""
        ...

    def ended(self) -> bool:
        """Whether the session's stream has ended."""
        ...

    def bulk_failed(self, reason: str) -> None:
        """Turn the bulk transport off for this session."""
        ...


class Transfer(abc.ABC):
    """A submitted batch: poll it with `status`, block on it with `wait`."""

    transfer_id: int

    @abc.abstractmethod
    def status(self) -> TransferState:
        """The batch's results so far."""

    @abc.abstractmethod
    def wait(self, timeout_s: float | None = None) -> TransferState:
        """The batch's results once done (or as they stand at the timeout)."""


class TransferPath(abc.ABC):
    """How a session's batches move block bytes.

    Args:
        session: the session whose regions and channel the path uses.
    """

    @abc.abstractmethod
    def __init__(self, session: SessionView) -> None: ...

    @abc.abstractmethod
    def read(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> Transfer:
        """Start a batch that fetches blocks into regions."""

    @abc.abstractmethod
    def write(self, groups: Sequence[DescriptorGroup], parent_hash: bytes, token_ids: Sequence[int],
              extra_keys: Sequence[bytes]) -> Transfer:
        """Start a batch that stores blocks from regions."""

    def read_many(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> list[Transfer]:
        """Start several read batches, one after another."""
        return [self.read(groups, prefix_only) for groups in batches]

    def wait_many(self, transfers: Sequence[Transfer], timeout_s: float | None) -> None:  # noqa: B027
        """Wait for several of this path's batches (their own `wait` then answers at once)."""

    def close(self) -> None:  # noqa: B027 - most paths hold nothing to release
        """Release what the path holds (threads)."""


def timeout(timeout_s: Any) -> float | None:
    """A wait's time limit: None (no limit) or a finite number of seconds, 0 or more."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 <= timeout_s < float("inf"):
        raise InvalidArgument(f"timeout_s must be None or a finite number of seconds >= 0, got {timeout_s!r}")
    return float(timeout_s)


class LocalTransfer(Transfer):
    """A batch run by a thread of this process (the stream path)."""

    def __init__(self, transfer_id: int, results: BatchResults, block_bytes: int, future: Future[None]) -> None:
        self.transfer_id = transfer_id
        self._results = results
        self._block_bytes = block_bytes
        self._future = future

    def status(self) -> TransferState:
        done = self._future.done()
        if done and self._future.exception() is not None:
            raise self._future.exception()  # type: ignore[misc]
        return self._results.state(self.transfer_id, done, self._block_bytes)

    def wait(self, timeout_s: float | None = None) -> TransferState:
        with contextlib.suppress(TimeoutError):
            self._future.result(timeout(timeout_s))
        return self.status()
