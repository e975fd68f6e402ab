"""Direct GPU restore: one kernel copies a request's blocks from the store's page cache to the GPU.

On the store's host, `kvstore.client.colocated.ColocatedReader` maps LMDB's data
file read-only in the worker's process and hands back a `MappedRead`: where
each found block lies in that mapping, under a read transaction that keeps its
pages from being reused. `GpuGather` then:

1. registers the page-aligned chunks of the mapping holding those blocks with
   CUDA, read-only and mapped (`kvstore.client.gpu_pinned`: within a pinned
   budget, least recently used chunks unregistered first; chunks stay
   registered for the next request, so a session's restore usually registers
   nothing);
2. launches one Triton kernel that reads every block straight from the host
   pages over PCIe, into a uint8 `[n, block_bytes]` tensor (`gather`) or
   scattered into the engine's per-layer row tensors (`scatter`: each source
   layer's compressed-KV rows and indexer rows to their own destinations, at
   the slots the caller names, e.g. the pages of its paged cache);
3. checks every block against its stored xxh3-64: for `gather`, a second kernel
   hashes the rows where they landed, in GPU memory (so the bytes checked are
   the bytes used, and host memory is read once); for `scatter` (or
   `checksums_on="cpu"`), CPU threads run `MappedRead.verify` (GIL-free) while
   the copy runs. A block that fails is a miss: the usable prefix ends before
   it and the server is told (`report_corrupt`).

No server copy, no shared region, no staging memcpy. Without CUDA or Triton,
or when registering fails, it raises `DirectGpuUnavailable` (a
`FailedPrecondition`): `kvstore.client.restore` then copies on the CPU.

Lifetime: a `GpuGather` serves one mapping at a time; call `close()` (or use
it as a context manager) before the reader's mapping is unmapped, so no pinned
range outlives it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore.client.gpu_layout import ScratchRead, columns, destinations
from kvstore.client.gpu_pinned import (
    BUDGET_BYTES,
    CHUNK_BYTES,
    CudaHost,
    DirectGpuUnavailable,
    PinnedRegistry,
    RegistryStats,
    chunk_bytes_checked,
)
from kvstore.client.gpu_rounds import DevicePointer, GatherResult, KernelRounds, MappedReadLike, kernels
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH, ModelGeometry

if TYPE_CHECKING:
    import torch

__all__ = ["DirectGpuUnavailable", "GatherResult", "GpuGather", "MappedReadLike"]

#: Words (4 bytes) per program of the gather kernel, and its warps: picked on the H200 (docs/DIRECT_RESTORE.md).
GATHER_BLOCK_WORDS = 2048
GATHER_WARPS = 8
SCATTER_BLOCK_WORDS = 1024
SCATTER_WARPS = 4


class GpuGather:
    """Copies a `MappedRead`'s blocks to the GPU with one kernel per budget round.

    Args:
        budget_bytes: most bytes of the mapping registered (pinned) at once.
        chunk_bytes: registration granule, a multiple of 4096 (64 MiB default).
        device: the CUDA device of the outputs (default: the current one).
        host: the register / unregister calls (tests substitute them; default CUDA's).
        checksums_on: "auto", "gpu" or "cpu" (see `checksums_on`).

    Raises:
        DirectGpuUnavailable: no CUDA device, or no torch.
    """

    def __init__(self, *, budget_bytes: int = BUDGET_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 device: str | int | torch.device | None = None, host: CudaHost | None = None,
                 checksums_on: str = "auto") -> None:
        if checksums_on not in ("auto", "gpu", "cpu"):
            raise InvalidArgument(f"checksums_on must be auto, gpu or cpu, got {checksums_on!r}")
        #: Where `gather` checks checksums: "gpu" (a kernel hashing the rows it landed, in HBM),
        #: "cpu" (MappedRead.verify on threads, beside the copy), "auto" (gpu where it can:
        #: blocks longer than 240 bytes, a multiple of 8; `scatter` always uses the CPU).
        self.checksums_on = checksums_on
        self.chunk_bytes = chunk_bytes_checked(chunk_bytes)
        self._host = host or CudaHost()
        import torch

        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise InvalidArgument(f"device must be a CUDA device, got {self.device}")
        self.registry = PinnedRegistry(self._host.register, self._host.unregister, budget_bytes=budget_bytes)
        #: Each request's rounds: register, launch, check (`kvstore.client.gpu_rounds`).
        self._rounds = KernelRounds(self.registry, self.device, self.chunk_bytes)

    @property
    def stats(self) -> RegistryStats:
        """Registration counts and time so far, and the peak bytes registered."""
        return self.registry.stats

    def __enter__(self) -> GpuGather:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unregister every chunk; call before the mapping it served is unmapped."""
        with self._rounds.lock:
            self.registry.clear()

    # -- the two forms ----------------------------------------------------

    def gather(self, read: MappedReadLike, out: torch.Tensor | None = None, *,
               verify: bool = True) -> tuple[torch.Tensor, GatherResult]:
        """Copy every block of `read` into rows of a uint8 `[n, block_bytes]` CUDA tensor.

        Args:
            read: the open `MappedRead` (its spans are the found prefix).
            out: where to write: uint8 `[>= n, block_bytes]`, contiguous, on `self.device`;
                new memory if None.
            verify: check every block's checksum (on the GPU after the copy, per `checksums_on`).

        Returns:
            (out, result): rows `[:result.blocks]` are the verified prefix.

        Raises:
            InvalidArgument: blocks of different sizes, or a bad `out`.
            DirectGpuUnavailable: no Triton, or registering failed.
        """
        import torch

        offsets, size = columns(read)
        n = len(offsets)
        if out is None:
            out = torch.empty((n, size), dtype=torch.uint8, device=self.device)
        elif (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] < n
              or out.shape[1] != size or not out.is_contiguous() or out.device != self.device):
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
            raise InvalidArgument(f"out: expected a contiguous uint8 tensor [>= {n}, {size}] on {self.device}, "
                                  f"got {got}")
        if n == 0:
            return out, self._rounds.finish(read, [], 0, 0, 0.0, time.perf_counter(), verify=False)
        launcher = kernels()
        words = size // 4
        dst = out.view(torch.int32)

        def launch(src: DevicePointer, offsets: torch.Tensor, members: list[int], align: int) -> None:
            grid = (len(members), -(-words // GATHER_BLOCK_WORDS))
            launcher.gather_kernel[grid](src, offsets, dst[members[0]:], WORDS=words, BLOCK=GATHER_BLOCK_WORDS,
                                         ALIGN=align, num_warps=GATHER_WARPS)

        # Row starts are 16-byte aligned when the block size and out's address are.
        on_gpu = verify and self.checksums_on != "cpu" and size > 240 and size % 8 == 0 and out.data_ptr() % 8 == 0
        return out, self._rounds.run(read, offsets, size, launch, verify=verify,
                                     extra_align=size if out.data_ptr() % 16 == 0 else 4,
                                     hash_rows=out[:n] if on_gpu else None)

    def scatter(self, read: MappedReadLike, layers: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
                slots: Sequence[int] | torch.Tensor | None = None, *, geometry: ModelGeometry = V4_1_FLASH,
                block_tokens: int = 64, verify: bool = True) -> GatherResult:
        """Copy each block's rows straight into per-layer destinations, in one kernel.

        Args:
            read: the open `MappedRead`.
            layers: for each source layer of the geometry, `(kv_dest, index_dest)`: uint8
                CUDA tensors `[slots, rows, row_bytes]` (or `[slots, rows * row_bytes]`) whose
                slot rows are contiguous, e.g. one layer's paged cache with a 64-token page.
            slots: the slot of each block (a page id), default 0..n-1.
            geometry, block_tokens: the block layout (`geometry.block_layout(block_tokens)`).
            verify: check every block's checksum on CPU threads while the kernel runs.

        Returns:
            The result; slots of blocks from `result.blocks` on hold unusable rows.

        Raises:
            InvalidArgument: a missing layer, a wrong dtype / shape / device / stride, a slot out
                of range, or blocks whose size is not the layout's.
            DirectGpuUnavailable: no Triton, or registering failed.
        """
        import torch

        offsets, found = columns(read)
        n = len(offsets)
        size = geometry.block_bytes(block_tokens)
        if n and found != size:
            raise InvalidArgument(f"blocks are {found} bytes; the layout of {geometry.name} at "
                                  f"{block_tokens} tokens is {size}")
        table, base, slots_t, align = destinations(layers, slots, n, geometry, block_tokens, self.device)
        if n == 0:
            return self._rounds.finish(read, [], 0, 0, 0.0, time.perf_counter(), verify=False)
        launcher = kernels()
        longest = max(int(w) for w in table[1].tolist())
        dst = DevicePointer(base, torch.int32)
        sec_src, sec_words, sec_dst, sec_stride = (t.to(self.device) for t in table)

        def launch(src: DevicePointer, offsets: torch.Tensor, members: list[int], align_src: int) -> None:
            grid = (len(members), len(sec_words), -(-longest // SCATTER_BLOCK_WORDS))
            launcher.scatter_kernel[grid](src, offsets, slots_t[members[0]:], dst, sec_src, sec_words, sec_dst,
                                          sec_stride, BLOCK=SCATTER_BLOCK_WORDS, ALIGN=min(align, align_src),
                                          num_warps=SCATTER_WARPS)

        return self._rounds.run(read, offsets, size, launch, verify=verify, extra_align=16 if align == 4 else 4)

    def warm_up(self, *, geometry: ModelGeometry = V4_1_FLASH, block_tokens: int = 64) -> float:
        """Compile both kernels for this geometry's blocks now, on a scratch mapping of two blocks,
        so an engine's first restore does not wait for Triton (about 0.5 s on the H200).

        Returns:
            Seconds it took.

        Raises:
            DirectGpuUnavailable: no Triton, or registration refused.
        """
        import mmap

        import numpy as np
        import torch

        started = time.perf_counter()
        size = geometry.block_bytes(block_tokens)
        stride = -(-(size + 16) // 4096) * 4096
        scratch = mmap.mmap(-1, 2 * stride)
        pages = np.frombuffer(scratch, dtype=np.uint8)
        try:
            read = ScratchRead(int(pages.ctypes.data), 2 * stride, np.array([16, stride + 16], dtype=np.int64),
                                size)
            out = torch.empty((2, size), dtype=torch.uint8, device=self.device)
            self.gather(read, out, verify=False)
            if size > 240 and size % 8 == 0:  # the checksum kernel too (its verdicts here mean nothing)
                with torch.cuda.device(self.device):
                    self._rounds.stored(read)
                    self._rounds.hash_on_gpu(torch.zeros(2, dtype=torch.int64, device=self.device), out, size)
            parts: dict[tuple[int, str], torch.Tensor] = {
                (s.layer, s.component): torch.empty((2, s.rows * s.row_bytes), dtype=torch.uint8, device=self.device)
                for s in geometry.block_layout(block_tokens)}
            layers = {layer: (parts[layer, "compressed_kv"], parts[layer, "indexer"])
                      for layer in geometry.kv_source_layers}
            self.scatter(read, layers, geometry=geometry, block_tokens=block_tokens, verify=False)
        finally:
            with self._rounds.lock:
                self.registry.clear()  # the scratch mapping goes now
            del pages
            scratch.close()
        return time.perf_counter() - started
