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
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidArgument
from kvstore.transfer import BatchResults, DescriptorGroup, TransferState

if TYPE_CHECKING:
    from kvstore.client.transfer import TransferSession


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
    def __init__(self, session: TransferSession) -> None: ...

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
