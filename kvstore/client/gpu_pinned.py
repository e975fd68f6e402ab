"""Which pages of the store's data-file mapping the GPU may read, within a pinned budget.

The direct GPU restore (`kvstore.client.gpu_gather`) lets the GPU read blocks in
place from this process's read-only mapping of LMDB's `data.mdb`. CUDA can read
host memory only once it is registered (`cudaHostRegister` with
`cudaHostRegisterReadOnly | cudaHostRegisterMapped`), which pins those pages of the
page cache. Registering the whole map is slow (0.43 s for 4 GiB) and pins every
tenant's blocks, so this module registers fixed, page-aligned chunks of the mapping
(64 MiB by default) that hold a request's blocks, clipped to the file's length
(pages past the end of the file cannot be pinned), keeps them registered for the
next request, and unregisters the least recently used ones when the budget would
be exceeded. A request larger than the budget is planned in rounds
(`plan_rounds`), each one's chunks fitting the budget.

Everything here but `CudaHost` is pure Python, so CI checks the bookkeeping
without a GPU; `PinnedRegistry` takes the register / unregister calls as
arguments.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.errors import FailedPrecondition, InvalidArgument

#: Default chunk: large enough that registering costs ~1.3 ms per chunk (measured on
#: the H200 host: 64 MiB in 1.3 ms), small enough that a session's blocks pin little else.
CHUNK_BYTES = 64 << 20
#: Default pinned budget: page-cache pages held resident for the GPU, not new memory.
BUDGET_BYTES = 4 << 30
PAGE_BYTES = 4096

#: cudaHostRegister flags (driver_types.h).
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08
#: cudaErrorHostMemoryAlreadyRegistered: the range overlaps memory someone else registered.
_ALREADY_REGISTERED = 712


class DirectGpuUnavailable(FailedPrecondition):
    """The direct GPU path cannot run here (no CUDA, no Triton, registration refused,
    a chunk larger than the budget); the restore facade falls back to the CPU copy."""

    retryable = False


class SpanLike(Protocol):
    """What the planner reads of a block (`kvstore.client.colocated.BlockSpan`)."""

    @property
    def offset(self) -> int: ...
    @property
    def size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Chunk:
    """One page-aligned range of the mapping: `[base + index * chunk_bytes, + length)`."""

    index: int
    start: int      # offset from the mapping's base
    length: int     # bytes, a multiple of PAGE_BYTES, inside the file


def chunk_bytes_checked(chunk_bytes: int) -> int:
    """`chunk_bytes` when it is a positive multiple of the page size, else InvalidArgument."""
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
        raise InvalidArgument(f"chunk_bytes must be a positive multiple of {PAGE_BYTES}, got {chunk_bytes!r}")
    return chunk_bytes


def chunks_of(span: SpanLike, map_length: int, chunk_bytes: int) -> list[Chunk]:
    """The chunks holding one block's bytes (two when it straddles a boundary).

    Raises:
        InvalidArgument: the block is not inside the first `map_length` bytes.
    """
    if span.offset < 0 or span.size <= 0 or span.offset + span.size > map_length:
        raise InvalidArgument(f"block at offset {span.offset} of {span.size} bytes is outside the "
                              f"{map_length} mapped bytes of the data file")
    first, last = span.offset // chunk_bytes, (span.offset + span.size - 1) // chunk_bytes
    end_of_file = -(-map_length // PAGE_BYTES) * PAGE_BYTES
    return [Chunk(i, i * chunk_bytes, min((i + 1) * chunk_bytes, end_of_file) - i * chunk_bytes)
            for i in range(first, last + 1)]


def plan_rounds(spans: Sequence[SpanLike], map_length: int, chunk_bytes: int,
                budget_bytes: int) -> list[tuple[Sequence[int], dict[int, Chunk]]]:
    """Split a request into rounds whose chunks fit the budget, keeping block order.

    Returns:
        [(positions in `spans`, {chunk index: Chunk})], one per round; one round
        when all the chunks fit.

    Raises:
        DirectGpuUnavailable: one block's chunks alone exceed the budget.
    """
    rounds: list[tuple[Sequence[int], dict[int, Chunk]]] = []
    members: list[int] = []
    chunks: dict[int, Chunk] = {}
    used = 0
    for pos, span in enumerate(spans):
        need = {c.index: c for c in chunks_of(span, map_length, chunk_bytes) if c.index not in chunks}
        extra = sum(c.length for c in need.values())
        if used + extra > budget_bytes and members:
            rounds.append((members, chunks))
            members, chunks, used = [], {}, 0
            need = {c.index: c for c in chunks_of(span, map_length, chunk_bytes)}
            extra = sum(c.length for c in need.values())
        if extra > budget_bytes:
            raise DirectGpuUnavailable(f"block {pos} needs {extra} bytes registered, over the pinned budget "
                                       f"of {budget_bytes} bytes", hint="raise the budget or lower chunk_bytes")
        members.append(pos)
        chunks.update(need)
        used += extra
    if members:
        rounds.append((members, chunks))
    return rounds


@dataclass
class RegistryStats:
    """What registering has cost so far (reported by the bench and `GpuGather.stats`)."""

    registrations: int = 0
    unregistrations: int = 0
    registered_bytes_total: int = 0   # bytes ever registered (re-registrations count again)
    register_s: float = 0.0           # time inside cudaHostRegister
    unregister_s: float = 0.0
    peak_bytes: int = 0               # most bytes registered at once
    history: list[tuple[int, int]] = field(default_factory=list)  # (chunk index, length) registered, in order


class PinnedRegistry:
    """Registered chunks of one mapping, least recently used first, within a budget.

    Args:
        register: `register(address, length)`, raising on failure.
        unregister: `unregister(address)`.
        budget_bytes: most bytes registered at once.
    """

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None], *,
                 budget_bytes: int = BUDGET_BYTES) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < PAGE_BYTES:
            raise InvalidArgument(f"budget_bytes must be at least {PAGE_BYTES}, got {budget_bytes!r}")
        self._register, self._unregister = register, unregister
        self.budget_bytes = budget_bytes
        self.base: int | None = None
        self._chunks: OrderedDict[int, Chunk] = OrderedDict()   # chunk index -> registered chunk, LRU first
        self.stats = RegistryStats()

    @property
    def used_bytes(self) -> int:
        """Bytes registered now."""
        return sum(c.length for c in self._chunks.values())

    def registered(self) -> dict[int, int]:
        """{chunk index: length} registered now, least recently used first."""
        return {i: c.length for i, c in self._chunks.items()}

    def ensure(self, base: int, chunks: Iterable[Chunk]) -> None:
        """Have every chunk of `chunks` registered over the mapping at `base`, marked most recent.

        A chunk registered shorter than asked (the file grew) is registered again;
        chunks outside `chunks` go, least recently used first, when room is needed;
        a new mapping (another `base`) drops every chunk of the old one first.

        Raises:
            DirectGpuUnavailable: `chunks` alone exceed the budget, or registering failed.
        """
        wanted = {c.index: c for c in chunks}
        if sum(c.length for c in wanted.values()) > self.budget_bytes:
            raise DirectGpuUnavailable(f"{len(wanted)} chunks exceed the pinned budget of {self.budget_bytes} bytes")
        if self.base is not None and base != self.base:
            self.clear()
        self.base = base
        for index, chunk in wanted.items():
            have = self._chunks.get(index)
            if have is not None and have.length >= chunk.length:
                self._chunks.move_to_end(index)
                continue
            if have is not None:
                self._drop(index)
            self._make_room(chunk.length, keep=wanted)
            start = time.perf_counter()
            self._register(base + chunk.start, chunk.length)
            self.stats.register_s += time.perf_counter() - start
            self.stats.registrations += 1
            self.stats.registered_bytes_total += chunk.length
            self.stats.history.append((index, chunk.length))
            self._chunks[index] = chunk
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.used_bytes)

    def _make_room(self, length: int, keep: dict[int, Chunk]) -> None:
        for index in list(self._chunks):
            if self.used_bytes + length <= self.budget_bytes:
                return
            if index not in keep:
                self._drop(index)

    def _drop(self, index: int) -> None:
        assert self.base is not None
        chunk = self._chunks.pop(index)
        start = time.perf_counter()
        self._unregister(self.base + chunk.start)
        self.stats.unregister_s += time.perf_counter() - start
        self.stats.unregistrations += 1

    def clear(self) -> None:
        """Unregister every chunk (call before the mapping goes away)."""
        for index in list(self._chunks):
            self._drop(index)
        self.base = None


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded into this process (one runtime, one context), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class SharedRegistrations:
    """The host ranges this process registered with CUDA, each counted per holder.

    CUDA refuses a second registration of registered memory in one process
    (cudaErrorHostMemoryAlreadyRegistered), yet two gatherers over one mapping (the
    restore's gatherer for a reader and a caller's own `GpuGather`, say) ask for the
    same chunks. A range already held at least as long is shared rather than
    registered again, and CUDA's unregister runs only when its last holder lets go,
    so one holder's eviction never unpins pages another's kernel is reading.

    Args:
        register: the raw `register(address, length)`, raising on failure.
        unregister: the raw `unregister(address)`.
    """

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None]) -> None:
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()
        self._held: dict[int, list[int]] = {}   # address -> [length, holders]

    def holders(self, address: int) -> int:
        """How many holders share the range registered at `address` (0: none)."""
        with self._lock:
            held = self._held.get(address)
            return 0 if held is None else held[1]

    def register(self, address: int, length: int) -> None:
        """Hold `[address, address + length)` registered: shared when held already, else registered."""
        with self._lock:
            held = self._held.get(address)
            if held is not None and held[0] >= length:
                held[1] += 1
                return
            self._register(address, length)  # a shorter hold: CUDA refuses, and says so
            self._held[address] = [length, 1]

    def unregister(self, address: int) -> None:
        """Let go of the range at `address`; CUDA unregisters it when nobody holds it any more."""
        with self._lock:
            held = self._held.get(address)
            if held is not None and held[1] > 1:
                held[1] -= 1
                return
            self._held.pop(address, None)
            self._unregister(address)


class CudaHost:
    """`cudaHostRegister` (read-only, mapped) and `cudaHostUnregister` on host ranges.

    Uses the CUDA runtime torch loaded, through ctypes (so it can also check the
    device address of a registered range: the gather kernel relies on unified
    addressing, a range's device address being its host address), or torch's own
    `torch.cuda.cudart()` binding where the runtime is linked statically.

    Raises:
        DirectGpuUnavailable: torch has no CUDA device.
    """

    FLAGS = HOST_REGISTER_MAPPED | HOST_REGISTER_READ_ONLY

    #: One table for the whole process: CUDA's registrations are per process, not per CudaHost.
    _shared: SharedRegistrations | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        try:
            import torch
        except ImportError as exc:
            raise DirectGpuUnavailable(f"torch is not installed: {exc}") from None
        if not torch.cuda.is_available():
            raise DirectGpuUnavailable("no CUDA device is available to this process")
        torch.cuda.init()
        self._lib = _loaded_cudart()
        self._torch_rt = None if self._lib is not None else torch.cuda.cudart()
        if self._lib is not None:
            self._lib.cudaGetErrorName.restype = ctypes.c_char_p
            self._lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            self._lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            self._lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                           ctypes.c_uint]

    def _error(self, code: int) -> str:
        if self._lib is None:
            return f"error {code}"
        self._lib.cudaGetLastError()  # clear it, so the next CUDA call (torch's too) does not see it
        name = self._lib.cudaGetErrorName(code)
        return f"{name.decode() if name else 'error'} ({code})"

    def _table(self) -> SharedRegistrations:
        with CudaHost._shared_lock:
            if CudaHost._shared is None:
                CudaHost._shared = SharedRegistrations(self._register_raw, self._unregister_raw)
            return CudaHost._shared

    def register(self, address: int, length: int) -> None:
        """Register `[address, address + length)` read-only and mapped, shared with this process's other
        holders of the same range (`SharedRegistrations`); DirectGpuUnavailable on failure."""
        self._table().register(address, length)

    def unregister(self, address: int) -> None:
        """Let go of the range registered at `address`; unregistered once no holder is left."""
        self._table().unregister(address)

    def _register_raw(self, address: int, length: int) -> None:
        if self._lib is None:
            code = int(self._torch_rt.cudaHostRegister(address, length, self.FLAGS))  # type: ignore[union-attr]
        else:
            code = int(self._lib.cudaHostRegister(address, length, self.FLAGS))
        if code:
            hint = ("another part of this process registered these pages" if code == _ALREADY_REGISTERED
                    else "the mapping must be a readable file mapping inside the file's length")
            raise DirectGpuUnavailable(f"cudaHostRegister of {length} bytes at {address:#x} failed: "
                                       f"{self._error(code)}", hint=hint)
        if self._lib is not None:
            device = ctypes.c_void_p()
            code = int(self._lib.cudaHostGetDevicePointer(ctypes.byref(device), address, 0))
            if code or device.value != address:
                self._unregister_raw(address)
                why = self._error(code) if code else "no unified addressing"
                raise DirectGpuUnavailable(f"registered host memory at {address:#x} has device address "
                                           f"{device.value!r} ({why})")

    def _unregister_raw(self, address: int) -> None:
        # Errors are cleared, not raised: it is cleanup.
        if self._lib is None:
            self._torch_rt.cudaHostUnregister(address)  # type: ignore[union-attr]
            return
        code = int(self._lib.cudaHostUnregister(address))
        if code:
            self._error(code)


def plan_rounds_array(offsets: Any, size: int, map_length: int, chunk_bytes: int,
                      budget_bytes: int) -> list[tuple[Sequence[int], dict[int, Chunk]]]:
    """`plan_rounds` for blocks of one size given as an int64 numpy array of offsets.

    The common case, every chunk within the budget, is one numpy pass (15,625
    blocks in well under a millisecond, against tens of ms for the span loop);
    otherwise it falls back to `plan_rounds`.
    """
    import numpy as np

    n = len(offsets)
    if n == 0:
        return []
    if size <= 0 or int(offsets.min()) < 0 or int(offsets.max()) + size > map_length:
        bad = int(np.argmax((offsets < 0) | (offsets + size > map_length))) if size > 0 else 0
        raise InvalidArgument(f"block at offset {int(offsets[bad])} of {size} bytes is outside the "
                              f"{map_length} mapped bytes of the data file")
    first = offsets // chunk_bytes
    last = (offsets + size - 1) // chunk_bytes
    present = np.zeros(int(last.max()) + 1, dtype=bool)  # a mark per chunk: no sort of 2n indices
    present[first] = True
    present[last] = True
    indices = np.flatnonzero(present)
    if size > chunk_bytes:  # a block spanning more than two chunks: the general loop
        return plan_rounds([_Span(int(o), size) for o in offsets], map_length, chunk_bytes, budget_bytes)
    end_of_file = -(-map_length // PAGE_BYTES) * PAGE_BYTES
    chunks = {int(i): Chunk(int(i), int(i) * chunk_bytes, min((int(i) + 1) * chunk_bytes, end_of_file)
                            - int(i) * chunk_bytes) for i in indices}
    if sum(c.length for c in chunks.values()) <= budget_bytes:
        return [(range(n), chunks)]
    return plan_rounds([_Span(int(o), size) for o in offsets], map_length, chunk_bytes, budget_bytes)


@dataclass(frozen=True, slots=True)
class _Span:
    offset: int
    size: int
