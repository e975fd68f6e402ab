"""One request's copy to the GPU, a budget round at a time, with its checksums.

`kvstore.client.gpu_gather.GpuGather` checks a request and builds its kernel launch;
`KernelRounds.run` then, for each round of blocks whose chunks of the mapping fit the pinned
budget (`kvstore.client.gpu_pinned`): registers those chunks, launches the kernel and times
it. The checksums run beside the copy (CPU threads, `MappedRead.verify`) or right behind it
(a kernel hashing the landed rows in GPU memory); the blocks that fail are reported to the
server and end the usable prefix (`GatherResult.blocks`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.client.gpu_layout import checksums, usable_prefix, xxh3_constants
from kvstore.client.gpu_pinned import DirectGpuUnavailable, PinnedRegistry, plan_rounds_array
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    import torch


class MappedReadLike(Protocol):
    """What `GpuGather` uses of `kvstore.client.colocated.MappedRead`."""

    @property
    def base_address(self) -> int: ...
    @property
    def map_length(self) -> int: ...
    @property
    def spans(self) -> Sequence[Any]: ...
    def verify(self, indices: Sequence[int] | None = None) -> list[bool]: ...
    def report_corrupt(self, indices: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class GatherResult:
    """What one gather or scatter did.

    Attributes:
        blocks: leading blocks usable (all copied and verified): rows of blocks
            at and after the first corrupt one must not be used.
        copied: blocks the kernel copied (all spans of the read).
        corrupt: `BlockSpan.index` of each block that failed its checksum (reported).
        rounds: kernel launches (more than one when the blocks' chunks exceed the budget).
        register_s: seconds spent registering chunks in this call (0 when all were registered).
        registered_bytes: bytes registered after the call; `budget_bytes` the budget.
        seconds: the whole call, wall clock, from the first registration to the verified end.
        copy_s: GPU time of the kernels (CUDA events), registration excluded.
        verify_s: the checksums' time: the GPU kernel's (CUDA events), or the CPU threads' wall time.
    """

    blocks: int
    copied: int
    corrupt: list[int]
    rounds: int
    register_s: float
    registered_bytes: int
    budget_bytes: int
    seconds: float
    copy_s: float = 0.0
    verify_s: float = 0.0


class DevicePointer:
    """A raw device address Triton accepts as a tensor argument (it reads `data_ptr()` and `dtype`)."""

    def __init__(self, address: int, dtype: Any) -> None:
        self._address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self._address


def kernels() -> Any:
    """The Triton kernels (`kvstore.client.gpu_kernels`), imported on first use."""
    try:
        from kvstore.client import gpu_kernels
    except ImportError as exc:  # no Triton, or one that cannot build here
        raise DirectGpuUnavailable(f"triton is not available: {exc}") from None
    return gpu_kernels


class KernelRounds:
    """Runs a request's kernel launches over one mapping, round by round, and checks what landed.

    Args:
        registry: the pinned chunks of the mapping (registered within its budget).
        device: the CUDA device the kernels run on.
        chunk_bytes: the registration granule.
    """

    def __init__(self, registry: PinnedRegistry, device: torch.device, chunk_bytes: int) -> None:
        self.registry, self.device, self.chunk_bytes = registry, device, chunk_bytes
        #: One request at a time touches the registry and launches.
        self.lock = threading.Lock()
        self._consts: torch.Tensor | None = None

    def run(self, read: MappedReadLike, offsets: Any, size: int, launch: Callable[..., None], *, verify: bool,
            extra_align: int, hash_rows: torch.Tensor | None = None) -> GatherResult:
        """Register, launch one kernel per round while CPU threads verify (or hash `hash_rows` on the
        GPU after the copy), then settle the corrupt ones."""
        import torch

        started = time.perf_counter()
        checks: list[bool] = []
        gpu_bad: list[int] | None = None
        failure: list[BaseException] = []
        verify_s = [0.0]

        def check() -> None:
            start = time.perf_counter()
            try:
                checks.extend(read.verify(None))
            except BaseException as exc:  # surfaced on the caller's thread below
                failure.append(exc)
            verify_s[0] = time.perf_counter() - start

        on_cpu = verify and hash_rows is None
        checker = threading.Thread(target=check, name="kvstore-gpu-verify") if on_cpu else None
        if checker is not None:
            checker.start()
        register_s = 0.0
        rounds = plan_rounds_array(offsets, size, read.map_length, self.chunk_bytes,
                                   self.registry.budget_bytes)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        copy_s = 0.0
        try:
            with self.lock, torch.cuda.device(self.device):
                stored = self.stored(read) if verify and hash_rows is not None else None
                for members, chunks in rounds:
                    before = self.registry.stats.register_s
                    self.registry.ensure(read.base_address, chunks.values())
                    register_s += self.registry.stats.register_s - before
                    first = min(chunks.values(), key=lambda c: c.start)
                    src = DevicePointer(read.base_address + first.start, torch.int32)
                    rel = offsets[members[0]:members[-1] + 1] - first.start
                    align = 4 if not (rel % 16).any() and extra_align % 16 == 0 else 1
                    if (rel % 4).any():
                        raise InvalidArgument("blocks must start at multiples of 4 bytes in the mapping")
                    words = torch.from_numpy(rel // 4).to(self.device, non_blocking=False)
                    began.record()
                    launch(src, words, members, align)
                    ended.record()
                    if len(rounds) > 1:
                        # The next round may unregister this round's chunks: the kernel must be done.
                        ended.synchronize()
                        copy_s += began.elapsed_time(ended) / 1e3
                if stored is not None and hash_rows is not None:  # queued right behind the copy
                    gpu_bad, verify_s[0] = self.hash_on_gpu(stored, hash_rows, size)
                ended.synchronize()
                if len(rounds) == 1:
                    copy_s = began.elapsed_time(ended) / 1e3
        finally:
            if checker is not None:
                checker.join()
        if failure:
            raise failure[0]
        bad = gpu_bad if gpu_bad is not None else [k for k, ok in enumerate(checks) if not ok]
        return self.finish(read, bad, len(offsets), len(rounds), register_s, started, verify=verify,
                            copy_s=copy_s, verify_s=verify_s[0])

    def stored(self, read: MappedReadLike) -> torch.Tensor:
        """The read's stored checksums on the device (int64 bits), and the xxh3 table once."""
        import numpy as np
        import torch

        if self._consts is None:
            self._consts = torch.from_numpy(xxh3_constants().view(np.int64)).to(self.device)
        return torch.from_numpy(checksums(read).view(np.int64)).to(self.device)

    def hash_on_gpu(self, stored: torch.Tensor, rows: torch.Tensor, size: int) -> tuple[list[int], float]:
        """xxh3-64 of each landed row against its stored checksum, one program per row:
        (the rows that failed, GPU seconds)."""
        import torch

        ok = torch.empty(len(rows), dtype=torch.int8, device=self.device)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        kernels().xxh3_kernel[(len(rows),)](rows.view(torch.int64), stored, ok, self._consts, ROW_WORDS=size // 8,
                                              LENGTH=size, num_warps=1)
        ended.record()
        bad = torch.nonzero(ok == 0).flatten().cpu().tolist()  # a few ints cross, not n flags
        return bad, began.elapsed_time(ended) / 1e3

    def finish(self, read: MappedReadLike, bad: list[int], copied: int, rounds: int, register_s: float,
               started: float, *, verify: bool, copy_s: float = 0.0, verify_s: float = 0.0) -> GatherResult:
        """Report the blocks that failed (`bad`, span positions) within what the Lookup found, and
        say how long a prefix is usable."""
        bad = bad if verify else []
        # Read after the kernels: a read opened with wait=False answers its Lookup here, so the
        # copy overlapped it; rows past what it found are not the caller's to use.
        found = getattr(read, "found_blocks", None)
        # Span k is the k-th block asked (the spans are the found prefix): its index is k.
        corrupt = [k for k in bad if k < found] if isinstance(found, int) and not isinstance(found, bool) else bad
        if corrupt:
            read.report_corrupt(corrupt)
        return GatherResult(blocks=usable_prefix(copied, corrupt, found), copied=copied,
                            corrupt=corrupt, rounds=rounds,
                            register_s=register_s, registered_bytes=self.registry.used_bytes,
                            budget_bytes=self.registry.budget_bytes, seconds=time.perf_counter() - started,
                            copy_s=copy_s, verify_s=verify_s)
