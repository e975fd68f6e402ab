"""Blocks of global KV are the model's rows: join them into blocks, split blocks back into rows.

A block of `block_tokens` tokens (64 by default) holds, for each source layer
of the geometry in order (2, 8, 14, 20 for V4.1-Flash), its compressed-KV rows
in position order, then its indexer-key rows in position order: 32 + 32 rows
for a ratio-2 layer, 64 + 64 for a ratio-1 layer, 56,960 bytes for V4.1-Flash
(`ModelGeometry.block_layout` gives the offsets). A row is the model's own
bytes (`kvstore.codec.rows`): 288 B of compressed KV (E2M1 + E4M3 scales), 68 B
of indexer key (E2M1 + UE8M0 scales). Nothing is transcoded, so an engine
copies a block into its paged caches with one copy per run of rows.

- `join_block` / `split_block`: one block, from / into per-layer row tensors
  (`split_block` returns views of the block: no copy).
- `join_blocks` / `split_blocks`: many blocks at once, from per-layer tensors of
  `n * rows` rows each (one copy per section for all blocks), into per-layer
  views `[n, rows, row_bytes]`.
- `encode_blocks` / `decode_blocks` (and the one-block forms): the same from /
  to float tensors, quantizing with `kvstore.codec.rows`.

Everything runs on the tensors' device (a CUDA block splits into CUDA views).
Each function takes numpy arrays as well as tensors, and the byte arguments
(blocks, and the rows `join_blocks` lays out) bytes, bytearray or memoryview
too; numpy in gives numpy back, anything else torch (`kvstore.codec.arrays`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, overload

import numpy as np
import torch

from kvstore.codec.arrays import (
    BYTE_KINDS,
    Buffer,
    NDArray,
    as_tensor,
    dtype_name,
    is_buffer,
    is_numpy,
    is_read_only,
    pairs_to_numpy,
    to_numpy,
)
from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry

#: Tokens per block unless told otherwise (the server's default `store.block_tokens`).
BLOCK_TOKENS = 64

#: Per source layer: (compressed-KV rows, indexer rows).
LayerRows = Mapping[int, tuple[torch.Tensor, torch.Tensor]]
#: The same as numpy arrays: what comes back is numpy too.
NumpyLayerRows = Mapping[int, tuple[NDArray, NDArray]]
#: Rows to join may also be flat byte buffers of whole rows.
ByteLayerRows = Mapping[int, tuple[torch.Tensor | Buffer, torch.Tensor | Buffer]]
#: Per source layer, as `split_blocks` and `decode_blocks` give them back.
TensorPairs = dict[int, tuple[torch.Tensor, torch.Tensor]]
NumpyPairs = dict[int, tuple[NDArray, NDArray]]
#: An `out` buffer: what is given is what comes back.
_Out = TypeVar("_Out", torch.Tensor, NDArray)


def _check_layers(geometry: ModelGeometry, layers: object) -> Mapping[int, object]:
    expected = list(geometry.kv_source_layers)
    if not isinstance(layers, Mapping):
        raise InvalidArgument(f"expected a dict {{layer: (kv_rows, index_rows)}} for layers {expected}, "
                              f"got {type(layers).__name__}")
    if sorted(layers) != expected:
        raise InvalidArgument(f"block of geometry {geometry.name!r}: expected layers {expected}, got {sorted(layers)}")
    return layers


def _pair(layer: int, value: object) -> tuple[object, object]:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise InvalidArgument(f"layer {layer}: expected a pair (kv_rows, index_rows), got {type(value).__name__}")
    return value[0], value[1]


_ROWS = (torch.uint8,)
_VALUES = (torch.float32, torch.bfloat16, torch.float16)


def _rows3(x: object, *, what: str, rows: int, width: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """`x` as `[n, rows, width]`, from `[n * rows, width]` or `[n, rows, width]` (or flat bytes of whole rows)."""
    shape = f"[n * {rows}, {width}] or [n, {rows}, {width}]"
    kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    raw = dtypes == _ROWS  # row bytes: a flat buffer of them is as good as an array
    wants = f"{kinds} {shape}" + (f" (a buffer: n * {rows * width} bytes)" if raw else "")
    flat = raw and is_buffer(x)
    t = as_tensor(x, what=what, wants=wants, buffers=raw)
    if flat:
        if t.numel() % (rows * width):
            raise InvalidArgument(f"{what}: expected a buffer of whole blocks of rows, n * {rows} x {width} "
                                  f"= n * {rows * width} bytes, got {t.numel()} bytes")
        return t.view(-1, rows, width)
    if t.dtype not in dtypes:
        raise InvalidArgument(f"{what}: expected {kinds}, got {dtype_name(t)}")
    ok = ((t.dim() == 2 and t.shape[0] % rows == 0) or (t.dim() == 3 and t.shape[1] == rows)) \
        and t.shape[-1] == width
    if not ok:
        raise InvalidArgument(f"{what}: expected shape {shape}, got {tuple(t.shape)}")
    return t.reshape(-1, rows, width)


def _gather(geometry: ModelGeometry, layers: object, block_tokens: int, *, dtypes: tuple[torch.dtype, ...],
            widths: tuple[int, int]) -> tuple[int, TensorPairs, bool]:
    """Check every layer's pair; return the block count, `[n, rows, width]` tensors, and whether all were numpy."""
    geometry.check_block_tokens(block_tokens)
    checked = _check_layers(geometry, layers)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    counts: set[int] = set()
    devices: set[torch.device] = set()
    numpy = True
    for layer in geometry.kv_source_layers:
        rows = geometry.block_rows(layer, block_tokens)
        kv, index = _pair(layer, checked[layer])
        numpy = numpy and is_numpy(kv) and is_numpy(index)
        pair = (_rows3(kv, what=f"layer {layer} compressed_kv", rows=rows, width=widths[0], dtypes=dtypes),
                _rows3(index, what=f"layer {layer} indexer", rows=rows, width=widths[1], dtypes=dtypes))
        counts.update(t.shape[0] for t in pair)
        devices.update(t.device for t in pair)
        out[layer] = pair
    if len(counts) != 1:
        raise InvalidArgument(f"layers hold rows for different numbers of blocks of {block_tokens} tokens: "
                              f"{sorted(counts)}")
    if len(devices) != 1:
        raise InvalidArgument(f"rows are on several devices: {sorted(map(str, devices))}")
    return counts.pop(), out, numpy


def _row_widths(geometry: ModelGeometry) -> tuple[int, int]:
    return geometry.compressed_kv_row_bytes, geometry.indexer_row_bytes


@overload
def join_blocks(geometry: ModelGeometry, layers: NumpyLayerRows, block_tokens: int = ..., *,
                out: None = ...) -> NDArray: ...
@overload
def join_blocks(geometry: ModelGeometry, layers: ByteLayerRows, block_tokens: int = ..., *,
                out: None = ...) -> torch.Tensor: ...
@overload
def join_blocks(geometry: ModelGeometry, layers: ByteLayerRows | NumpyLayerRows, block_tokens: int = ..., *,
                out: _Out) -> _Out: ...
def join_blocks(geometry: ModelGeometry, layers: ByteLayerRows | NumpyLayerRows, block_tokens: int = BLOCK_TOKENS,
                *, out: torch.Tensor | NDArray | None = None) -> torch.Tensor | NDArray:
    """Build `n` blocks from per-layer row tensors, one copy per section for all blocks.

    Args:
        geometry: the model's cache geometry.
        layers: for each source layer, `(kv_rows, index_rows)`: uint8 tensors or
            numpy arrays of `[n * rows, row_bytes]` (rows of consecutive blocks
            follow each other, in position order) or `[n, rows, row_bytes]`, or
            flat buffers (bytes, bytearray, memoryview) of those bytes; rows is
            `block_tokens / compress_ratio` (32 or 64 for V4.1-Flash 64-token
            blocks) and row_bytes 288 (compressed KV) or 68 (indexer). All on one device.
        block_tokens: tokens per block, a multiple of geometry.token_alignment.
        out: where to write, a uint8 `[n, block_bytes]` tensor on the rows'
            device (or a writable numpy array) whose rows are contiguous (e.g.
            pinned memory); new memory if None.

    Returns:
        uint8 `[n, geometry.block_bytes(block_tokens)]`, ready for `Client.put`:
        `out` when given; else a numpy array when every row array was numpy, a
        tensor on the rows' device otherwise.

    Raises:
        InvalidArgument: a missing or extra layer, a wrong type, dtype, width or
            row count, layers of different block counts, or a bad `out`.
    """
    n, rows3, numpy = _gather(geometry, layers, block_tokens, dtypes=_ROWS, widths=_row_widths(geometry))
    size = geometry.block_bytes(block_tokens)
    device = rows3[geometry.kv_source_layers[0]][0].device
    dest = torch.empty((n, size), dtype=torch.uint8, device=device) if out is None else _out(out, n, size, device)
    for s in geometry.block_layout(block_tokens):
        src = rows3[s.layer][0 if s.component == "compressed_kv" else 1]
        dest[:, s.offset:s.offset + s.size_bytes].view(n, s.rows, s.row_bytes).copy_(src)
    if out is not None:
        return out
    return to_numpy(dest) if numpy else dest


def _out(out: object, n: int, size: int, device: torch.device) -> torch.Tensor:
    wants = f"a uint8 tensor [{n}, {size}] on {device} with contiguous rows"
    if is_read_only(out):
        raise InvalidArgument(f"out: expected {wants}, got a read-only numpy array")
    dest = as_tensor(out, what="out", wants=wants)
    if dest.dtype != torch.uint8 or tuple(dest.shape) != (n, size) or dest.stride(-1) != 1 or dest.device != device:
        raise InvalidArgument(f"out: expected {wants}, got {dtype_name(dest)} {tuple(dest.shape)} on {dest.device}"
                              f"{'' if dest.stride(-1) == 1 else ' with strided rows'}")
    return dest


@overload
def join_block(geometry: ModelGeometry, layers: NumpyLayerRows, block_tokens: int = ...) -> NDArray: ...
@overload
def join_block(geometry: ModelGeometry, layers: ByteLayerRows, block_tokens: int = ...) -> torch.Tensor: ...
def join_block(geometry: ModelGeometry, layers: ByteLayerRows | NumpyLayerRows,
               block_tokens: int = BLOCK_TOKENS) -> torch.Tensor | NDArray:
    """One block from per-layer rows: `{layer: (kv_rows[rows, 288], index_rows[rows, 68])}`.

    Takes what `join_blocks` takes.

    Returns:
        uint8 `[geometry.block_bytes(block_tokens)]`: numpy when the rows were,
        else a tensor on the rows' device (`bytes(t.cpu().numpy())` when bytes are wanted).

    Raises:
        InvalidArgument: as `join_blocks`, or rows for more than one block.
    """
    n, _, _ = _gather(geometry, layers, block_tokens, dtypes=_ROWS, widths=_row_widths(geometry))
    if n != 1:
        raise InvalidArgument(f"join_block takes the rows of one block of {block_tokens} tokens; "
                              f"these hold {n} (use join_blocks)")
    return join_blocks(geometry, layers, block_tokens)[0]


@overload
def split_block(geometry: ModelGeometry, block: NDArray, block_tokens: int = ...) -> NumpyPairs: ...
@overload
def split_block(geometry: ModelGeometry, block: torch.Tensor | Buffer, block_tokens: int = ...) -> TensorPairs: ...
def split_block(geometry: ModelGeometry, block: torch.Tensor | Buffer | NDArray,
                block_tokens: int = BLOCK_TOKENS) -> TensorPairs | NumpyPairs:
    """The rows of one block, as views of it (no copy): the inverse of `join_block`.

    Args:
        geometry: the model's cache geometry.
        block: bytes, bytearray, memoryview, or a 1-D contiguous uint8 tensor (CPU
            or CUDA) or numpy array, of `geometry.block_bytes(block_tokens)`.
        block_tokens: tokens in the block.

    Returns:
        Source layer -> `(kv_rows[rows, 288], index_rows[rows, 68])`, uint8,
        contiguous: numpy arrays for a numpy block, tensors otherwise. Every one
        aliases `block`: valid while it is alive and unchanged (for a buffer lent
        by LMDB, only until its transaction ends), and not to be written to when
        `block` is read-only (bytes; a read-only array gives read-only arrays).

    Raises:
        InvalidArgument: wrong type or length, or a block size the geometry cannot hold.
    """
    buf = as_uint8(block, expected_bytes=geometry.block_bytes(block_tokens), what="block")
    parts: dict[tuple[int, str], torch.Tensor] = {}
    for s in geometry.block_layout(block_tokens):
        parts[s.layer, s.component] = buf[s.offset:s.offset + s.size_bytes].view(s.rows, s.row_bytes)
    pairs = {layer: (parts[layer, "compressed_kv"], parts[layer, "indexer"]) for layer in geometry.kv_source_layers}
    return pairs_to_numpy(pairs, read_only=is_read_only(block)) if is_numpy(block) else pairs


@overload
def split_blocks(geometry: ModelGeometry, blocks: NDArray, block_tokens: int = ...) -> NumpyPairs: ...
@overload
def split_blocks(geometry: ModelGeometry, blocks: torch.Tensor | Buffer, block_tokens: int = ...) -> TensorPairs: ...
def split_blocks(geometry: ModelGeometry, blocks: torch.Tensor | Buffer | NDArray,
                 block_tokens: int = BLOCK_TOKENS) -> TensorPairs | NumpyPairs:
    """The rows of `n` blocks, as views (no copy): the inverse of `join_blocks`.

    Args:
        geometry: the model's cache geometry.
        blocks: a uint8 tensor or numpy array `[n, block_bytes]` whose rows are
            contiguous (what `Client.get_tensor` returns), or one buffer of
            `n * block_bytes` as `split_block` takes it.
        block_tokens: tokens per block.

    Returns:
        Source layer -> `(kv_rows[n, rows, 288], index_rows[n, rows, 68])`, uint8
        views of `blocks` (strided across blocks: `.reshape(-1, 288)` copies):
        numpy arrays for numpy blocks, tensors otherwise.

    Raises:
        InvalidArgument: wrong type, dtype, shape or length.
    """
    grid = block_grid(geometry, blocks, block_tokens)
    n = grid.shape[0]
    parts: dict[tuple[int, str], torch.Tensor] = {}
    for s in geometry.block_layout(block_tokens):
        parts[s.layer, s.component] = grid[:, s.offset:s.offset + s.size_bytes].view(n, s.rows, s.row_bytes)
    pairs = {layer: (parts[layer, "compressed_kv"], parts[layer, "indexer"]) for layer in geometry.kv_source_layers}
    return pairs_to_numpy(pairs, read_only=is_read_only(blocks)) if is_numpy(blocks) else pairs


def block_grid(geometry: ModelGeometry, blocks: torch.Tensor | Buffer | NDArray,
               block_tokens: int = BLOCK_TOKENS) -> torch.Tensor:
    """`blocks` checked as `split_blocks` checks them, as one uint8 tensor `[n, block_bytes]` (a view, no copy).

    For a caller that needs the checks but not the per-layer views (a whole-block kernel): building those
    views is a few microseconds a section, a fraction of a millisecond for a V4.1 block.

    Raises:
        InvalidArgument: wrong type, dtype, shape or length.
    """
    size = geometry.block_bytes(block_tokens)
    given = _tensor_blocks(blocks)
    if isinstance(given, torch.Tensor) and given.dim() == 2:
        if given.dtype != torch.uint8 or given.shape[1] != size or given.stride(1) != 1:
            raise InvalidArgument(f"blocks: expected a uint8 tensor or array [n, {size}] with contiguous rows, "
                                  f"got {dtype_name(given)} of shape {tuple(given.shape)}")
        grid = given
    else:
        length = _length(given)
        if length is None or length % size:
            got = f"{length} bytes" if length is not None else type(blocks).__name__ + f"; accepted: {BYTE_KINDS}"
            raise InvalidArgument(f"blocks: expected a whole number of {size}-byte blocks, got {got}")
        grid = as_uint8(given, expected_bytes=length, what="blocks").view(-1, size)
    return grid


def _length(data: object) -> int | None:
    if isinstance(data, torch.Tensor):
        return data.numel() if data.dim() == 1 else None
    if is_buffer(data):
        return memoryview(data).nbytes  # type: ignore[arg-type]
    return None


# -- float tensors <-> blocks, with the model's quantization ------------------------

@overload
def encode_blocks(geometry: ModelGeometry, layers: NumpyLayerRows, block_tokens: int = ...) -> NDArray: ...
@overload
def encode_blocks(geometry: ModelGeometry, layers: LayerRows, block_tokens: int = ...) -> torch.Tensor: ...
def encode_blocks(geometry: ModelGeometry, layers: LayerRows | NumpyLayerRows,
                  block_tokens: int = BLOCK_TOKENS) -> torch.Tensor | NDArray:
    """Quantize per-layer float tensors to the model's rows and build `n` blocks.

    Args:
        layers: for each source layer, `(kv[n * rows, head_dim], index_key[n * rows,
            index_head_dim])` (or `[n, rows, ...]`), float32, bfloat16 or float16
            tensors or float32/float16 numpy arrays, on one device: the
            compressor's output and the indexer's keys.

    Returns:
        uint8 `[n, block_bytes]`: numpy when every input was, else on the tensors' device.

    Raises:
        InvalidArgument: as `join_blocks`; NaN or Inf.
    """
    from kvstore.codec import rows

    _, values, numpy = _gather(geometry, layers, block_tokens, dtypes=_VALUES,
                               widths=(geometry.head_dim, geometry.index_head_dim))
    quantized = {layer: (rows.compressed_kv_rows(kv), rows.indexer_key_rows(index))
                 for layer, (kv, index) in values.items()}
    blocks = join_blocks(geometry, quantized, block_tokens)
    return to_numpy(blocks) if numpy else blocks


@overload
def encode_block(geometry: ModelGeometry, layers: NumpyLayerRows, block_tokens: int = ...) -> NDArray: ...
@overload
def encode_block(geometry: ModelGeometry, layers: LayerRows, block_tokens: int = ...) -> torch.Tensor: ...
def encode_block(geometry: ModelGeometry, layers: LayerRows | NumpyLayerRows,
                 block_tokens: int = BLOCK_TOKENS) -> torch.Tensor | NDArray:
    """One block from per-layer float values `{layer: (kv[rows, head_dim], index_key[rows, index_head_dim])}`.

    Takes what `encode_blocks` takes.

    Returns:
        uint8 `[block_bytes]`: numpy when the values were, else on the tensors' device.
    """
    data = encode_blocks(geometry, layers, block_tokens)
    if data.shape[0] != 1:
        raise InvalidArgument(f"encode_block takes the values of one block of {block_tokens} tokens; "
                              f"these hold {data.shape[0]} (use encode_blocks)")
    return data[0]


@overload
def decode_blocks(geometry: ModelGeometry, blocks: NDArray, block_tokens: int = ..., *,
                  dtype: torch.dtype = ...) -> NumpyPairs: ...
@overload
def decode_blocks(geometry: ModelGeometry, blocks: torch.Tensor | Buffer, block_tokens: int = ..., *,
                  dtype: torch.dtype = ...) -> TensorPairs: ...
def decode_blocks(geometry: ModelGeometry, blocks: torch.Tensor | Buffer | NDArray, block_tokens: int = BLOCK_TOKENS,
                  *, dtype: torch.dtype = torch.float32) -> TensorPairs | NumpyPairs:
    """Dequantize `n` blocks: source layer -> `(kv[n, rows, head_dim], index_key[n, rows, index_head_dim])`.

    Takes what `split_blocks` takes. Exact (code times scale) in float32; new
    memory, on the blocks' device; numpy arrays for numpy blocks (a `dtype`
    numpy has: not bfloat16).
    """
    from kvstore.codec import rows

    pairs = {layer: (rows.decode_compressed_kv_rows(kv, dtype=dtype),
                     rows.decode_indexer_key_rows(index, dtype=dtype))
             for layer, (kv, index) in split_blocks(geometry, _tensor_blocks(blocks), block_tokens).items()}
    return pairs_to_numpy(pairs) if is_numpy(blocks) else pairs


@overload
def decode_block(geometry: ModelGeometry, block: NDArray, block_tokens: int = ..., *,
                 dtype: torch.dtype = ...) -> NumpyPairs: ...
@overload
def decode_block(geometry: ModelGeometry, block: torch.Tensor | Buffer, block_tokens: int = ..., *,
                 dtype: torch.dtype = ...) -> TensorPairs: ...
def decode_block(geometry: ModelGeometry, block: torch.Tensor | Buffer | NDArray, block_tokens: int = BLOCK_TOKENS,
                 *, dtype: torch.dtype = torch.float32) -> TensorPairs | NumpyPairs:
    """Dequantize one block: source layer -> `(kv[rows, head_dim], index_key[rows, index_head_dim])`.

    Takes what `split_block` takes; numpy arrays back for a numpy block.
    """
    from kvstore.codec import rows

    pairs = {layer: (rows.decode_compressed_kv_rows(kv, dtype=dtype),
                     rows.decode_indexer_key_rows(index, dtype=dtype))
             for layer, (kv, index) in split_block(geometry, _tensor_blocks(block), block_tokens).items()}
    return pairs_to_numpy(pairs) if is_numpy(block) else pairs


def _tensor_blocks(data: torch.Tensor | Buffer | NDArray) -> torch.Tensor | Buffer:
    """A numpy block (or blocks) as a tensor over it, so decoding runs on tensors; others as they are."""
    return as_tensor(data, what="blocks", wants="uint8 blocks", views=True) if isinstance(data, np.ndarray) else data


def as_uint8(data: object, *, expected_bytes: int, what: str) -> torch.Tensor:
    """`data` as a 1-D uint8 tensor sharing its memory, after checking its length.

    Args:
        data: bytes, bytearray, memoryview (C-contiguous, one-byte items), or a
            1-D contiguous uint8 tensor or numpy array.
        expected_bytes: the length it must have.
        what: how messages name it.

    Returns:
        A view of `data`, on data's device for a tensor, on the CPU otherwise. It
        keeps `data` alive but not whatever lent `data` (an LMDB transaction).

    Raises:
        InvalidArgument: wrong type, dtype, layout or length.
    """
    buf = as_tensor(data, what=what, wants=f"{expected_bytes} bytes", buffers=True, views=True)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        kind = "array" if is_numpy(data) else "tensor"
        raise InvalidArgument(f"{what}: expected a 1-D contiguous uint8 {kind} (or bytes), got {dtype_name(buf)} "
                              f"of shape {tuple(buf.shape)}")
    if buf.numel() != expected_bytes:
        raise InvalidArgument(f"{what}: expected {expected_bytes} bytes, got {buf.numel()}")
    return buf
