"""Batched transfers: descriptors, their groups, per-descriptor results, and the span rule.

A transfer is one batch of descriptors with one operation (read: store ->
region, write: region -> store), as in NIXL's transfer requests. Each
descriptor names a block and where its bytes sit in a registered region.

Callers hand over `Descriptor` lists and read `TransferState.results`, but a
batch travels and is worked on as columns: consecutive descriptors that share a
region and a length form one `DescriptorGroup` (packed hashes, an array of
offsets), and results are one status byte per descriptor (`BatchResults`) plus
entries for the failed ones only. Per-descriptor objects are built only when a
caller asks for `results`. Checks run per group, vectorized over its offsets.
The values here are shared by the client and the server; neither torch nor
gRPC is imported.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError, to_status
from kvstore.prefix import HASH_BYTES


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


#: Status by its one-byte code in `BatchResults.statuses` (the wire's DescriptorStatus values).
STATUSES: tuple[Status, ...] = (Status.PENDING, Status.DONE, Status.MISSING, Status.SKIPPED, Status.FAILED)
#: One-byte code of each status.
CODES: dict[Status, int] = {s: i for i, s in enumerate(STATUSES)}
DONE, MISSING, SKIPPED, FAILED = (CODES[s] for s in (Status.DONE, Status.MISSING, Status.SKIPPED, Status.FAILED))
#: Why a SKIPPED descriptor was not read (the same for all, so it is not sent).
SKIPPED_REASON = "after the first block not loaded"
#: Longest failure reason kept (UTF-8 bytes): a batch's state on the wire stays within
#: TransferSettings.TRANSFER_STATE_BYTES_PER_DESCRIPTOR per descriptor.
MAX_REASON_BYTES = 256


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

    def __post_init__(self) -> None:
        # Checked here, so a bad one never reaches numpy or protobuf (a bare
        # OverflowError or TypeError there); a hash of the wrong length is the
        # server's to fail, alone (rule 4).
        if not isinstance(self.block_hash, bytes | bytearray | memoryview):
            raise InvalidArgument(f"block_hash is a {type(self.block_hash).__name__}; a block hash is "
                                  f"{HASH_BYTES} bytes")
        for name, least in (("region_id", 0), ("offset_bytes", 0), ("length_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or not least <= value < 1 << 63:
                raise InvalidArgument(f"Descriptor.{name} must be an int in [{least}, 2**63), got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DescriptorGroup:
    """Consecutive descriptors of a batch sharing a region and a length: how a batch travels.

    Attributes:
        region_id: the region every descriptor of the group names.
        length_bytes: every descriptor's length.
        offsets_bytes: one offset per descriptor (int64 or uint64; not copied).
        block_hashes: reads: the chain hashes, `HASH_BYTES` each, concatenated; writes: empty.
    """

    region_id: int
    length_bytes: int
    offsets_bytes: np.ndarray
    block_hashes: bytes = b""

    def __len__(self) -> int:
        return len(self.offsets_bytes)

    def hash(self, i: int) -> bytes:
        """Descriptor i's block hash."""
        return self.block_hashes[i * HASH_BYTES: (i + 1) * HASH_BYTES]

    @classmethod
    def slots(cls, hashes: Sequence[bytes], *, region_id: int, offset_bytes: int, length_bytes: int
              ) -> DescriptorGroup:
        """Blocks into consecutive slots of one region, starting at `offset_bytes` (a fetch)."""
        return cls(region_id=region_id, length_bytes=length_bytes, block_hashes=b"".join(hashes),
                   offsets_bytes=offset_bytes + length_bytes * np.arange(len(hashes), dtype=np.int64))


def group(descriptors: Sequence[Descriptor], op: Op) -> list[DescriptorGroup]:
    """`descriptors` as groups of consecutive ones sharing a region and a length.

    A read descriptor whose hash is not `HASH_BYTES` long forms a group of its
    own, so the check that fails it fails nothing else.
    """
    def key(d: Descriptor) -> tuple[int, int, bool | int]:
        ok = op is Op.WRITE or len(d.block_hash) == HASH_BYTES
        return d.region_id, d.length_bytes, ok or id(d)

    groups = []
    for (region_id, length_bytes, _), run in itertools.groupby(descriptors, key):
        members = list(run)
        groups.append(DescriptorGroup(
            region_id=region_id, length_bytes=length_bytes,
            offsets_bytes=np.array([d.offset_bytes for d in members], dtype=np.int64),
            block_hashes=b"" if op is Op.WRITE else b"".join(d.block_hash for d in members)))
    return groups


def group_failures(g: DescriptorGroup, first: int, *, region_bytes: int, block_bytes: int, op: Op
                   ) -> dict[int, str]:
    """Why descriptors of `g` break the size, hash or span rules, by batch index (`first` is g's first).

    All of them are INVALID_ARGUMENT; an empty dict when the whole group is good.
    The span check is one vectorized comparison over the group's offsets.
    """
    n = len(g)
    if g.length_bytes != block_bytes:
        return {i: f"descriptor {i} length_bytes is {g.length_bytes}; blocks of this geometry are "
                   f"{block_bytes} bytes" for i in range(first, first + n)}
    if op is Op.READ and len(g.block_hashes) != n * HASH_BYTES:
        size = len(g.block_hashes) if n == 1 else f"{len(g.block_hashes) / n:g} on average"
        return {i: f"descriptor {i} block_hash is {size} bytes; a block hash is {HASH_BYTES} bytes"
                for i in range(first, first + n)}
    limit = region_bytes - g.length_bytes  # an offset past this runs over the end
    offsets = g.offsets_bytes
    bad = np.arange(n) if limit < 0 else np.flatnonzero((offsets < 0) | (offsets > limit))
    # Plain ints, not numpy scalars: a batch of bad spans is cut on the event loop.
    tail = f") runs outside region {g.region_id} of {region_bytes} bytes"
    length = g.length_bytes
    return {first + j: f"descriptor {first + j} span [{o}, {o + length}{tail}"
            for j, o in zip(bad.tolist(), offsets[bad].tolist(), strict=True)}


@dataclass(frozen=True, kw_only=True)
class Spans:
    """A checked batch's descriptor spans, cut into views only when asked.

    One region view per group (None where the group failed whole) and one
    ok-flag per descriptor: checking a batch costs a few vectorized steps, and
    the threads that copy cut the views of the chunk they copy (`cut`) rather
    than the event loop cutting one per descriptor up front.
    """

    groups: Sequence[DescriptorGroup]
    views: list[memoryview | None]
    #: Index of each group's first descriptor, and the batch's size last.
    starts: list[int]
    #: Per descriptor: False where it failed a check.
    ok: np.ndarray

    def __len__(self) -> int:
        return self.starts[-1]

    def first_failed(self) -> int | None:
        """Index of the first descriptor that failed a check, if any."""
        bad = np.flatnonzero(~self.ok)
        return int(bad[0]) if len(bad) else None

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, DescriptorGroup, int, int]]:
        """(group index, group, first, end) of each group's part of descriptors [lo, hi), both in the group."""
        k = max(bisect.bisect_right(self.starts, lo) - 1, 0)  # a batch may hold a group per descriptor
        while k < len(self.groups) and self.starts[k] < hi:
            start = self.starts[k]
            a, b = max(lo, start), min(hi, self.starts[k + 1])
            if a < b:
                yield k, self.groups[k], a - start, b - start
            k += 1

    def cut(self, lo: int, hi: int) -> list[memoryview | None]:
        """Views of descriptors [lo, hi), None where one failed."""
        out: list[memoryview | None] = []
        for k, g, a, b in self.pieces(lo, hi):
            view, length = self.views[k], g.length_bytes
            if view is None:
                out.extend([None] * (b - a))
                continue
            part: list[memoryview | None] = [view[o: o + length] for o in g.offsets_bytes[a:b].tolist()]
            ok = self.ok[self.starts[k] + a: self.starts[k] + b]
            if not ok.all():
                for j in np.flatnonzero(~ok).tolist():
                    part[j] = None
            out.extend(part)
        return out


def check_spans(groups: Sequence[DescriptorGroup], op: Op, block_bytes: int, results: BatchResults,
                region_view: Callable[[int], memoryview]) -> Spans:
    """Check each descriptor's span in its region, recording failures in `results`.

    Both paths make these checks, so a descriptor fails the same way on either.
    A region the caller may not use (`region_view` raises) fails its whole group;
    a bad length, hash or span fails only the descriptors that have it (rule 4).

    Args:
        groups: the batch.
        op: what the batch does (reads need a hash per descriptor).
        block_bytes: the geometry's block size.
        results: where failures go.
        region_view: a region's whole view by id; raises KVStoreError when it may not be used.

    Returns:
        The spans; their views are valid as long as their regions' views.
    """
    starts = [0, *itertools.accumulate(len(g) for g in groups)]
    ok = np.ones(starts[-1], dtype=bool)
    views: list[memoryview | None] = []
    for k, g in enumerate(groups):
        first, n = starts[k], len(g)
        try:
            view = region_view(g.region_id)
        except KVStoreError as exc:
            results.fail_all(dict.fromkeys(range(first, first + n), exc.message), to_status(exc).name)
            ok[first: first + n] = False
            views.append(None)
            continue
        bad = group_failures(g, first, region_bytes=len(view), block_bytes=block_bytes, op=op)
        ok[list(bad)] = False
        results.fail_all(bad)
        views.append(view)
    return Spans(groups=groups, views=views, starts=starts, ok=ok)


def cut_spans(groups: Sequence[DescriptorGroup], op: Op, block_bytes: int, results: BatchResults,
              region_view: Callable[[int], memoryview]) -> list[memoryview | None]:
    """Each descriptor's bytes in its region, or None with its failure recorded: `check_spans`, all cut."""
    spans = check_spans(groups, op, block_bytes, results, region_view)
    return spans.cut(0, len(spans))


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


class BatchResults:
    """A batch's results as it runs, in columns: filled by whoever runs the batch.

    Args:
        size: descriptors in the batch (all PENDING at first).
        writes: keep a chain hash per descriptor.

    Attributes:
        statuses: one `CODES` byte per descriptor.
        failures: (code, reason) of each FAILED descriptor, by index.
        bytes_moved: bytes copied so far.
        block_hashes: writes: `HASH_BYTES` per descriptor, the hash a DONE block was stored under.
    """

    def __init__(self, size: int, *, writes: bool = False) -> None:
        self.writes = writes
        self.statuses = bytearray(size)
        self.failures: dict[int, tuple[str, str]] = {}
        self.bytes_moved = 0
        self.block_hashes = bytearray(size * HASH_BYTES if writes else 0)

    def __len__(self) -> int:
        return len(self.statuses)

    def fail(self, index: int, code: str, reason: str) -> None:
        """Descriptor `index` failed with gRPC status name `code` (`reason` cut to MAX_REASON_BYTES)."""
        if len(reason) > MAX_REASON_BYTES // 4 and (not reason.isascii() or len(reason) > MAX_REASON_BYTES):
            reason = reason.encode()[:MAX_REASON_BYTES].decode(errors="ignore")
        self.failures[index] = (code, reason)  # first: a snapshot taken between the two stays whole
        self.statuses[index] = FAILED

    def fail_all(self, reasons: Mapping[int, str], code: str = "INVALID_ARGUMENT") -> None:
        """Fail every descriptor in `reasons` (index -> reason)."""
        for i, reason in reasons.items():
            self.fail(i, code, reason)

    def fail_pending(self, indices: Iterable[int], code: str, reason: str) -> None:
        """Fail those of `indices` still PENDING."""
        for i in indices:
            if self.statuses[i] == 0:
                self.fail(i, code, reason)

    def pending(self) -> np.ndarray:
        """Indices still PENDING."""
        return np.flatnonzero(np.frombuffer(self.statuses, dtype=np.uint8) == 0)

    def state(self, transfer_id: int, done: bool, block_bytes: int) -> TransferState:
        """A snapshot (copies the columns: safe while the batch goes on)."""
        return TransferState(transfer_id=transfer_id, done=done, statuses=bytes(self.statuses),
                             failures=dict(self.failures), bytes_moved=self.bytes_moved,
                             block_bytes=block_bytes, block_hashes=bytes(self.block_hashes))


@dataclass(frozen=True, kw_only=True)
class TransferState:
    """A batch's results so far, in descriptor order.

    Attributes:
        transfer_id: the batch.
        done: whether every descriptor is settled.
        statuses: one `CODES` byte per descriptor.
        bytes_moved: bytes copied in all.
        block_bytes: bytes each DONE descriptor moved (the geometry's block size).
        failures: (code, reason) of each FAILED descriptor, by index.
        block_hashes: writes: `HASH_BYTES` per descriptor, the chain hash of a DONE block.
    """

    transfer_id: int
    done: bool
    statuses: bytes = field(repr=False)
    bytes_moved: int
    block_bytes: int
    failures: Mapping[int, tuple[str, str]] = field(default_factory=dict, repr=False)
    block_hashes: bytes = field(default=b"", repr=False)

    @cached_property
    def results(self) -> list[DescriptorResult]:
        """One result per descriptor, built on first use (a batch is kept as columns until then)."""
        shared = {CODES[Status.PENDING]: DescriptorResult(status=Status.PENDING),
                  DONE: DescriptorResult(status=Status.DONE, bytes_moved=self.block_bytes),
                  MISSING: DescriptorResult(status=Status.MISSING),
                  SKIPPED: DescriptorResult(status=Status.SKIPPED, reason=SKIPPED_REASON)}
        out = [shared.get(c) for c in self.statuses]
        for i, (code, reason) in self.failures.items():
            out[i] = DescriptorResult(status=Status.FAILED, code=code, reason=reason)
        if self.block_hashes:
            for i in np.flatnonzero(np.frombuffer(self.statuses, dtype=np.uint8) == DONE).tolist():
                h = self.block_hashes[i * HASH_BYTES: (i + 1) * HASH_BYTES]
                out[i] = DescriptorResult(status=Status.DONE, bytes_moved=self.block_bytes, block_hash=h)
        return out  # type: ignore[return-value]  # every code is in `shared` or `failures`

    def count(self, status: Status) -> int:
        """How many descriptors stand at `status`."""
        return self.statuses.count(CODES[status])

    @property
    def done_prefix(self) -> int:
        """Leading descriptors that are DONE (what a worker can load contiguously)."""
        return len(self.statuses) - len(self.statuses.lstrip(bytes([DONE])))

    @classmethod
    def concat(cls, states: Sequence[TransferState], *, transfer_id: int = 0) -> TransferState:
        """Consecutive batches' states as one (a fetch's), their descriptors numbered across them."""
        failures: dict[int, tuple[str, str]] = {}
        base = 0
        for s in states:
            failures.update((base + i, f) for i, f in s.failures.items())
            base += len(s.statuses)
        hashes = b"".join(s.block_hashes for s in states) if any(s.block_hashes for s in states) else b""
        return cls(transfer_id=transfer_id, done=all(s.done for s in states),
                   statuses=b"".join(s.statuses for s in states), failures=failures,
                   bytes_moved=sum(s.bytes_moved for s in states),
                   block_bytes=states[0].block_bytes if states else 0, block_hashes=hashes)
