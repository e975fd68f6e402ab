"""Batched transfers: descriptors, their per-descriptor results, and the span rule.

A transfer is one batch of descriptors with one operation (read: store ->
region, write: region -> store), as in NIXL's transfer requests. Each
descriptor names a block and where its bytes sit in a registered region. The
values here are shared by the client and the server; neither torch nor gRPC
is imported.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument


class Op(str, enum.Enum):
    """What a batch does."""

    READ = "read"    # store -> region
    WRITE = "write"  # region -> store


class Status(str, enum.Enum):
    """Where one descriptor stands."""

    PENDING = "pending"
    DONE = "done"
    MISSING = "missing"   # reads: the block is not stored
    SKIPPED = "skipped"   # reads with prefix_only: after the first block not found
    FAILED = "failed"     # see the result's code and reason


@dataclass(frozen=True, kw_only=True, slots=True)
class Descriptor:
    """One block and where its bytes sit in a registered region.

    Attributes:
        block_hash: the block's chain hash (reads; ignored by writes, which hash tokens).
        region_id: the region's handle from `register`.
        offset_bytes: where the block starts in the region.
        length_bytes: the block's size (must equal the geometry's block bytes).
    """

    block_hash: bytes = b""
    region_id: int
    offset_bytes: int
    length_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DescriptorResult:
    """What happened to one descriptor.

    Attributes:
        status: where it stands.
        code: for FAILED, the gRPC status name of the cause (INVALID_ARGUMENT, ...).
        reason: for FAILED (and SKIPPED), why, in words.
        bytes_moved: bytes copied for it.
        block_hash: writes: the chain hash the block was stored under.
    """

    status: Status
    code: str = ""
    reason: str = ""
    bytes_moved: int = 0
    block_hash: bytes = b""


@dataclass(frozen=True, kw_only=True)
class TransferState:
    """A batch's results so far, in descriptor order."""

    transfer_id: int
    done: bool
    results: list[DescriptorResult] = field(repr=False)
    bytes_moved: int

    def count(self, status: Status) -> int:
        """How many descriptors stand at `status`."""
        return sum(r.status is status for r in self.results)

    @property
    def done_prefix(self) -> int:
        """Leading descriptors that are DONE (what a worker can load contiguously)."""
        n = 0
        for r in self.results:
            if r.status is not Status.DONE:
                break
            n += 1
        return n


def check_span(region_bytes: int, offset_bytes: int, length_bytes: int, *, region_id: int) -> None:
    """The span rule: a descriptor's bytes lie wholly inside its region.

    Raises:
        InvalidArgument: the span is empty or runs past the region's end.
    """
    if length_bytes <= 0:
        raise InvalidArgument(f"descriptor length_bytes is {length_bytes}; it must be positive")
    if offset_bytes < 0 or offset_bytes + length_bytes > region_bytes:
        raise InvalidArgument(
            f"descriptor span [{offset_bytes}, {offset_bytes + length_bytes}) runs outside region "
            f"{region_id} of {region_bytes} bytes"
        )
