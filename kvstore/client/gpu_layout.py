"""The direct GPU restore's bookkeeping around the kernels: where a read's blocks are, and
where the scatter writes them (`kvstore.client.gpu_gather` uses these).

Split out so the checks run without a GPU in CI and gpu_gather.py stays about launching.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry

if TYPE_CHECKING:
    import torch


class ReadColumns(Protocol):
    """What these helpers read of a `MappedRead`."""

    @property
    def spans(self) -> Sequence[Any]: ...


def destinations(layers: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
                 slots: Sequence[int] | torch.Tensor | None, n: int, geometry: ModelGeometry,
                 block_tokens: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], int, torch.Tensor, int]:
    """The scatter's table, checked: per section of the block layout (source word offset, words,
    destination word offset from the base, slot stride in words) as int64 CPU tensors, the
    destinations' base address, the slots on `device`, and the word alignment (4: 16-byte
    accesses, or 1).

    Raises:
        InvalidArgument: a missing or extra layer, a destination of the wrong dtype, device,
            shape or strides, slots of the wrong count or out of range, or addresses that are
            not multiples of 4 bytes.
    """
    import torch

    if not isinstance(layers, Mapping) or sorted(layers) != sorted(geometry.kv_source_layers):
        got = sorted(layers) if isinstance(layers, Mapping) else type(layers).__name__
        raise InvalidArgument(f"layers: expected {{layer: (kv_dest, index_dest)}} for layers "
                              f"{list(geometry.kv_source_layers)}, got {got}")
    rows: list[tuple[int, int, torch.Tensor, int]] = []  # (src offset, bytes, dest, slot stride bytes)
    capacity = None
    for s in geometry.block_layout(block_tokens):
        pair = layers[s.layer]
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidArgument(f"layer {s.layer}: expected a pair (kv_dest, index_dest)")
        dest = pair[0 if s.component == "compressed_kv" else 1]
        what = f"layer {s.layer} {s.component} destination"
        if (not isinstance(dest, torch.Tensor) or dest.dtype != torch.uint8 or dest.device != device
                or dest.dim() not in (2, 3) or dest.shape[0] < 1):
            found = f"{dest.dtype} {tuple(dest.shape)} on {dest.device}" if isinstance(dest, torch.Tensor) \
                else type(dest).__name__
            raise InvalidArgument(f"{what}: expected a uint8 tensor [slots, {s.rows}, {s.row_bytes}] on "
                                  f"{device}, got {found}")
        section = s.rows * s.row_bytes
        inner_ok = (dest.dim() == 3 and tuple(dest.shape[1:]) == (s.rows, s.row_bytes)
                    and dest.stride(2) == 1 and dest.stride(1) == s.row_bytes) or \
                   (dest.dim() == 2 and dest.shape[1] == section and dest.stride(1) == 1)
        if not inner_ok:
            raise InvalidArgument(f"{what}: expected [slots, {s.rows}, {s.row_bytes}] with contiguous rows "
                                  f"per slot, got shape {tuple(dest.shape)} strides {dest.stride()}")
        capacity = dest.shape[0] if capacity is None else min(capacity, dest.shape[0])
        rows.append((s.offset, section, dest, dest.stride(0)))
    assert capacity is not None
    if slots is None:
        if n > capacity:
            raise InvalidArgument(f"{n} blocks but the destinations hold {capacity} slots")
        slot_t = torch.arange(n, dtype=torch.int64)
    else:
        slot_t = torch.as_tensor(slots, dtype=torch.int64).cpu().reshape(-1)
        if slot_t.numel() != n:
            raise InvalidArgument(f"slots: expected {n} slot ids (one per found block), got {slot_t.numel()}")
        if n and (int(slot_t.min()) < 0 or int(slot_t.max()) >= capacity):
            raise InvalidArgument(f"slots must be in [0, {capacity}), got {int(slot_t.min())}.."
                                  f"{int(slot_t.max())}")
    base = min(d.data_ptr() for _, _, d, _ in rows)
    numbers = [(off, nbytes, d.data_ptr() - base, stride) for off, nbytes, d, stride in rows]
    if any(x % 4 for row in numbers for x in row) or base % 4:
        raise InvalidArgument("destinations and the block layout must be multiples of 4 bytes")
    align = 4 if not base % 16 and not any(x % 16 for row in numbers for x in row) else 1
    table = tuple(torch.tensor([row[k] // 4 for row in numbers], dtype=torch.int64) for k in range(4))
    return table, base, slot_t.to(device), align



class ScratchRead:
    """A `MappedRead` over a scratch mapping (warm_up): columns only, every block intact."""

    def __init__(self, base: int, length: int, offsets: Any, size: int) -> None:
        import numpy as np

        self.base_address, self.map_length, self.offsets = base, length, offsets
        self.sizes = np.full(len(offsets), size, dtype=np.int64)
        self.spans: list[Any] = []

    def verify(self, indices: Sequence[int] | None = None) -> list[bool]:
        return [True] * len(self.offsets)

    def report_corrupt(self, indices: Sequence[int]) -> None:
        return None


def columns(read: ReadColumns) -> tuple[Any, int]:
    """The blocks' offsets (int64 numpy) and their one size, from the read's columns where it has
    them (`MappedRead.offsets` / `.sizes`: no object per block), else from its spans.

    Raises:
        InvalidArgument: blocks of several sizes, or a size that is not a multiple of 4 bytes.
    """
    import numpy as np

    found = getattr(read, "offsets", None)
    if found is not None:
        offsets = np.asarray(found, dtype=np.int64)
        sizes = np.asarray(read.sizes, dtype=np.int64)  # type: ignore[attr-defined]
    else:
        spans = list(read.spans)
        offsets = np.fromiter((s.offset for s in spans), dtype=np.int64, count=len(spans))
        sizes = np.fromiter((s.size for s in spans), dtype=np.int64, count=len(spans))
    if not len(offsets):
        return offsets, 0
    size = int(sizes[0])
    if (sizes != size).any():
        raise InvalidArgument(f"blocks of several sizes in one read: {sorted(set(sizes.tolist()))[:5]}")
    if size % 4:
        raise InvalidArgument(f"block size {size} is not a multiple of 4 bytes")
    return offsets, size


def checksums(read: ReadColumns) -> Any:
    """The blocks' stored xxh3-64 (uint64 numpy), from `MappedRead.checksums` or the spans."""
    import numpy as np

    found = getattr(read, "checksums", None)
    if found is not None:
        return np.array(found, dtype=np.uint64)  # a writable copy: torch.from_numpy takes it as is
    return np.fromiter((s.checksum for s in read.spans), dtype=np.uint64, count=len(read.spans))


#: XXH3's default secret (xxhash.h, XXH3_kSecret): xxh3-64 with seed 0, what the store writes.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_P32 = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)
_P64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)


def xxh3_constants() -> Any:
    """The table `gpu_kernels.xxh3_kernel` reads (uint64 numpy, 163 words; layout in its docstring)."""
    import numpy as np

    def word(offset: int) -> int:
        return int.from_bytes(XXH3_SECRET[offset:offset + 8], "little")

    table = [word(8 * (s + lane)) for s in range(16) for lane in range(8)]  # stripe s uses secret + 8s
    table += [word(128 + 8 * lane) for lane in range(8)]   # scramble: the secret's last 64 bytes
    table += [word(121 + 8 * lane) for lane in range(8)]   # the last stripe: 192 - 64 - 7
    table += [word(11 + 8 * lane) for lane in range(8)]    # merging the accumulators
    table += [_P32[2], _P64[0], _P64[1], _P64[2], _P64[3], _P32[1], _P64[4], _P32[0]]  # initial accumulators
    table += [_P32[0], _P64[0], 0x165667919E3779F9]
    return np.array(table, dtype=np.uint64)


def usable_prefix(copied: int, bad: Sequence[int], found: object) -> int:
    """Blocks a caller may use: the copied prefix before the first corrupt block, and no more
    than the Lookup found (`MappedRead.found_blocks`, read after the copy, so a read whose
    Lookup answers while the kernel runs overlaps the two; None or absent: no such cut)."""
    blocks = min(bad) if bad else copied
    if isinstance(found, int) and not isinstance(found, bool):
        blocks = min(blocks, max(found, 0))
    return blocks
