"""The direct GPU restore's synthetic mapped file and kernel sweep (`python -m
kvstore.bench.transfer_direct --sweep`): a file laid out like LMDB's overflow
values, read without a server, so the gather kernel's variants can be timed alone
and the GPU tests can check it without a store.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.bench.harness import best_of
from kvstore.bench.report import Figure

PAGE = 4096
#: LMDB keeps a large value on overflow pages: a 16-byte page header, then the value.
OVERFLOW_HEADER = 16


@dataclass(frozen=True, slots=True)
class FileSpan:
    """A block inside `MappedFile` (the fields of `kvstore.client.colocated.BlockSpan`)."""

    index: int
    offset: int
    size: int
    checksum: int


class MappedFile:
    """A file laid out like LMDB's overflow values (each block 16 bytes into its own run of
    pages), mapped read-only, read back in a shuffled order: a `MappedRead` without a server.

    `corrupt(k)` flips a byte of the k-th span's block in the file (the checksum stays).
    """

    def __init__(self, n: int, block_bytes: int, *, seed: int = 0, folder: str | None = None,
                 order: Sequence[int] | None = None) -> None:
        import xxhash

        rng = np.random.default_rng(seed)
        self.block_bytes = block_bytes
        self.stride = -(-(block_bytes + OVERFLOW_HEADER) // PAGE) * PAGE
        fd, self.path = tempfile.mkstemp(prefix="kvstore-direct-", dir=folder)
        self.blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * PAGE)  # a meta page first, as LMDB's
            page = np.zeros(self.stride, dtype=np.uint8)
            for block in self.blocks:
                page[OVERFLOW_HEADER:OVERFLOW_HEADER + block_bytes] = block
                f.write(page.tobytes())
        self.order = list(order) if order is not None else [int(i) for i in rng.permutation(n)]
        self.spans = [FileSpan(index=pos, offset=PAGE + k * self.stride + OVERFLOW_HEADER, size=block_bytes,
                               checksum=xxhash.xxh3_64_intdigest(self.blocks[k].tobytes()))
                      for pos, k in enumerate(self.order)]
        self.map_length = os.path.getsize(self.path)
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed in close())
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.base_address = int(self._array.ctypes.data)
        self.reported: list[int] = []

    def expected(self) -> np.ndarray:
        """The blocks in span order, `[n, block_bytes]`."""
        return self.blocks[self.order]

    def verify(self, indices: Sequence[int] | None = None) -> list[bool]:
        """Checksum of each span's bytes in the mapping against the stored one."""
        import xxhash

        picked = range(len(self.spans)) if indices is None else indices
        spans = self.spans
        return [xxhash.xxh3_64_intdigest(self._array[spans[k].offset:spans[k].offset + spans[k].size])  # type: ignore[arg-type]
                == spans[k].checksum for k in picked]

    def report_corrupt(self, indices: Sequence[int]) -> None:
        """Remember what would have been reported to the server."""
        self.reported.extend(indices)

    def corrupt(self, k: int) -> None:
        """Flip one byte of span k's block in the file (the page cache the mapping shows)."""
        with open(self.path, "r+b") as f:
            f.seek(self.spans[k].offset + 100)
            byte = f.read(1)
            f.seek(self.spans[k].offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))

    def close(self) -> None:
        """Unmap and delete the file."""
        del self._array
        self._map.close()
        self._file.close()
        os.unlink(self.path)

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sweep(n: int, block_bytes: int, repeat: int, notes: dict[str, object]) -> list[Figure]:
    """The gather kernel's tile sizes and warps on a synthetic mapped file, timed alone
    with CUDA events (median of `triton.testing.do_bench`), against the pinned copy timed the same way."""
    import torch
    import triton

    from kvstore.client import gpu_kernels
    from kvstore.client.gpu_gather import GpuGather
    from kvstore.client.gpu_rounds import DevicePointer

    out: list[Figure] = []
    total = n * block_bytes
    words = block_bytes // 4
    pinned = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned_ms = triton.testing.do_bench(lambda: flat.copy_(pinned, non_blocking=True), warmup=50, rep=300,
                                        return_mode="median")
    base = "contiguous pinned H2D of the same bytes (events)"
    h2d = total / pinned_ms / 1e6
    with MappedFile(n, block_bytes, folder=os.environ.get("KVSTORE_DIRECT_SCRATCH")) as mapped, \
            GpuGather() as gather:
        dest = torch.empty((n, block_bytes), dtype=torch.uint8, device="cuda")
        start = time.perf_counter()
        gather.gather(mapped, dest)
        notes["sweep first gather s (registers, compiles)"] = round(time.perf_counter() - start, 3)
        if not torch.equal(dest.cpu(), torch.from_numpy(mapped.expected())):
            raise RuntimeError("sweep: gathered bytes differ")
        first = min(gather.registry.registered()) * gather.chunk_bytes
        src = DevicePointer(mapped.base_address + first, torch.int32)
        offsets = np.array([s.offset for s in mapped.spans], dtype=np.int64) - first
        src_words = torch.from_numpy(offsets // 4).cuda()
        dst = dest.view(torch.int32)
        ptx: dict[str, object] = {}
        variants: list[tuple[str, Callable[[], Any]]] = []

        def tiles(piece: int, warps: int) -> Callable[[], Any]:
            return lambda: gpu_kernels.gather_kernel[(n, -(-words // piece))](
                src, src_words, dst, WORDS=words, BLOCK=piece, ALIGN=4, num_warps=warps)

        for piece in (1024, 2048, 4096):
            for warps in (4, 8):
                variants.append((f"tiles of {piece * 4} B, {warps} warps", tiles(piece, warps)))
        for name, fn in variants:
            dest.fill_(0)
            compiled = fn()
            torch.cuda.synchronize()
            ok = torch.equal(dest.cpu(), torch.from_numpy(mapped.expected()))
            text = compiled.asm.get("ptx", "") if hasattr(compiled, "asm") else ""
            ptx[name] = {"ld.v4": text.count("ld.global.v4"), "ld": text.count("ld.global"), "correct": ok}
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            out.append(Figure.against(f"sweep gather kernel, {name}", total / ms / 1e6, "GB/s", base, h2d))
        notes["sweep ptx loads"] = ptx
        gather.gather(mapped, dest, verify=False)
        wall = best_of(lambda: gather.gather(mapped, dest, verify=False), repeat)
        out.append(Figure.against("sweep GpuGather.gather, no checksums (wall)", total / wall / 1e9, "GB/s", base,
                                  h2d))
        _, result = gather.gather(mapped, dest, verify=False)
        notes["sweep gather result"] = {"copy_ms": round(result.copy_s * 1e3, 3),
                                        "seconds_ms": round(result.seconds * 1e3, 3)}
        notes["sweep registration"] = {"registrations": gather.stats.registrations,
                                       "register_ms": round(gather.stats.register_s * 1e3, 3),
                                       "bytes": gather.stats.registered_bytes_total}
    return out


