"""One SWA snapshot as bytes: the window rows of every layer, then the raw tail at an odd length.

A snapshot at prompt length T (kvstore.swa_snapshot has its size and key; docs/SWA_POOL.md):

    window rows  uint8 [layers, min(T, window), window_row_bytes]   layer order, position order
    raw tail     float32 [ratio-2 source layers, 2, head_dim]       only when T is odd:
                                                                    kv then score, little-endian

For V4.1-Flash: 40 x 128 x 528 = 2,703,360 B at an even T >= 128, plus
3 x 2 x 512 x 4 = 12,288 B of tail at an odd T. T and the geometry are not in the
bytes: the caller knows T (it is in the key and the record).

`join_snapshot` and `split_snapshot` move rows as they are (the window rows come
from `kvstore.codec.rows.swa_rows`, or straight from an engine's cache);
`encode_snapshot` and `decode_snapshot` go through float window KV. The float32
tail is viewed and written in host byte order: little-endian hosts only (x86, ARM).
Each takes numpy arrays as well as tensors, and the bytes (a snapshot, the window
rows) as bytes, bytearray or memoryview too; numpy in gives numpy back, anything
else torch, and a snapshot built is bytes (`kvstore.codec.arrays`).
"""

from __future__ import annotations

from typing import overload

import numpy as np
import torch

from kvstore.codec.arrays import Buffer, NDArray, as_tensor, dtype_name, is_buffer, is_numpy, is_read_only, to_numpy
from kvstore.codec.block_codec import as_uint8
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH, ModelGeometry
from kvstore.swa_snapshot import SnapshotShape, check_position, snapshot_bytes, snapshot_shape


def _check_window_rows(rows: object, shape: SnapshotShape, geometry: ModelGeometry) -> torch.Tensor:
    wants = (f"uint8 [{shape.layers}, n, {shape.row_bytes}] with 1 <= n <= {shape.window} "
             f"(geometry {geometry.name!r})")
    flat = is_buffer(rows)
    t = as_tensor(rows, what="snapshot window rows", wants=wants + ", or a buffer of those bytes", buffers=True)
    if flat and t.numel() % (shape.layers * shape.row_bytes) == 0:
        t = t.view(shape.layers, -1, shape.row_bytes)  # a buffer of whole rows of every layer
    if (t.dtype != torch.uint8 or t.dim() != 3 or t.shape[0] != shape.layers or t.shape[2] != shape.row_bytes
            or not 1 <= t.shape[1] <= shape.window):
        got = f"{t.numel()} bytes" if flat else f"{dtype_name(t)} {tuple(t.shape)}"
        raise InvalidArgument(f"snapshot window rows: expected {wants}, got {got}")
    return t


def _check_tail(tail: object, shape: SnapshotShape, geometry: ModelGeometry) -> torch.Tensor:
    expected = (len(shape.ratio2_layers), 2, shape.tail_channels)
    wants = (f"float32 {list(expected)} [ratio-2 source layers {list(shape.ratio2_layers)}, kv/score, head_dim] "
             f"(geometry {geometry.name!r})")
    t = as_tensor(tail, what="snapshot tail", wants=wants)
    if t.dtype != torch.float32 or tuple(t.shape) != expected:
        raise InvalidArgument(f"snapshot tail: expected {wants}, got {dtype_name(t)} {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise InvalidArgument("snapshot tail holds NaN or Inf")
    return t


def _host_bytes(x: torch.Tensor) -> bytes:
    raw: bytes = x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return raw


def join_snapshot(window_rows: torch.Tensor | NDArray | Buffer, tail: torch.Tensor | NDArray | None, *,
                  geometry: ModelGeometry = V4_1_FLASH) -> bytes:
    """The bytes of one snapshot: its window rows, then its raw tail when there is one.

    Args:
        window_rows: uint8 `[layers, n, window_row_bytes]` (`[40, n, 528]` for V4.1-Flash),
            n = min(T, window): the rows of positions [T - n, T) of every layer; a
            tensor on any device, a numpy array, or a buffer of those bytes.
        tail: float32 `[ratio-2 source layers, 2, head_dim]` (`[3, 2, 512]`), a tensor
            or numpy array: each ratio-2 source layer's last-token kv then gate
            score, when T is odd; None when T is even.
        geometry: sizes the snapshot.

    Returns:
        The snapshot bytes (host memory), `kvstore.swa_snapshot.snapshot_bytes(geometry, T)` long.

    Raises:
        InvalidArgument: a wrong type, dtype or shape; NaN or Inf in the tail; a tail
            with fewer than a full window of rows only fits an odd n (T = n < window).
    """
    shape = snapshot_shape(geometry)
    rows = _check_window_rows(window_rows, shape, geometry)
    n = rows.shape[1]
    if tail is None:
        if n < shape.window and n % 2:
            raise InvalidArgument(f"snapshot of {n} window rows is at T = {n}, odd: it needs its raw tail")
        return _host_bytes(rows)
    tail = _check_tail(tail, shape, geometry)
    if n < shape.window and n % 2 == 0:
        raise InvalidArgument(f"snapshot of {n} window rows is at T = {n}, even: it has no raw tail")
    return _host_bytes(rows) + _host_bytes(tail)


@overload
def split_snapshot(data: NDArray, position: int, geometry: ModelGeometry = ...) -> tuple[NDArray, NDArray | None]: ...
@overload
def split_snapshot(data: torch.Tensor | Buffer, position: int, geometry: ModelGeometry = ...
                   ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
def split_snapshot(data: torch.Tensor | Buffer | NDArray, position: int, geometry: ModelGeometry = V4_1_FLASH
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[NDArray, NDArray | None]:
    """The window rows and raw tail of a snapshot at T = `position`, as views of `data` (no copy).

    Args:
        data: bytes, bytearray, memoryview, or a 1-D contiguous uint8 tensor or
            numpy array, of `snapshot_bytes(geometry, T)`.
        position: T, the prompt length the snapshot was taken at.
        geometry: sizes the snapshot.

    Returns:
        `(window_rows, tail)`: uint8 `[layers, min(T, window), window_row_bytes]`, and
        float32 `[ratio-2 source layers, 2, head_dim]` when T is odd, else None:
        numpy arrays for a numpy `data`, tensors otherwise. They alias `data`:
        valid while `data` is alive and unchanged, and not to be written to when
        `data` is read-only (bytes; a read-only array gives read-only arrays).

    Raises:
        InvalidArgument: a bad T, or data of the wrong type or length.
    """
    t = check_position(position)
    shape = snapshot_shape(geometry)
    buf = as_uint8(data, expected_bytes=snapshot_bytes(geometry, t), what=f"SWA snapshot at T = {t}")
    n = shape.window_positions(t)
    split = shape.layers * n * shape.row_bytes
    rows = buf[:split].view(shape.layers, n, shape.row_bytes)
    tail = None if not t % 2 else buf[split:].view(torch.float32).view(len(shape.ratio2_layers), 2,
                                                                       shape.tail_channels)
    if not is_numpy(data):
        return rows, tail
    ro = is_read_only(data)
    return to_numpy(rows, read_only=ro), None if tail is None else to_numpy(tail, read_only=ro)


def encode_snapshot(window: torch.Tensor | NDArray, tail: torch.Tensor | NDArray | None, *,
                    geometry: ModelGeometry = V4_1_FLASH) -> bytes:
    """A snapshot from float window KV: `swa_rows` of every row, joined with the tail.

    Args:
        window: float `[layers, n, head_dim]`, the window KV of positions [T - n, T):
            a float32, bfloat16 or float16 tensor on any device (the rows are
            quantized there), or a float32/float16 numpy array.
        tail: as in `join_snapshot`.
        geometry: sizes the snapshot.

    Raises:
        InvalidArgument: a wrong shape or dtype; NaN or Inf.
    """
    from kvstore.codec.rows import swa_rows

    shape = snapshot_shape(geometry)
    wants = f"a float [{shape.layers}, n, {shape.tail_channels}] (geometry {geometry.name!r})"
    values = as_tensor(window, what="snapshot window", wants=wants)
    if values.dim() != 3 or values.shape[0] != shape.layers or values.shape[2] != shape.tail_channels:
        raise InvalidArgument(f"snapshot window: expected {wants}, got {tuple(values.shape)}")
    return join_snapshot(swa_rows(values), tail, geometry=geometry)


@overload
def decode_snapshot(data: NDArray, position: int, geometry: ModelGeometry = ..., *,
                    dtype: torch.dtype = ...) -> tuple[NDArray, NDArray | None]: ...
@overload
def decode_snapshot(data: torch.Tensor | Buffer, position: int, geometry: ModelGeometry = ..., *,
                    dtype: torch.dtype = ...) -> tuple[torch.Tensor, torch.Tensor | None]: ...
def decode_snapshot(data: torch.Tensor | Buffer | NDArray, position: int, geometry: ModelGeometry = V4_1_FLASH, *,
                    dtype: torch.dtype = torch.float32
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[NDArray, NDArray | None]:
    """The window KV `[layers, min(T, window), head_dim]` of `dtype` and the raw tail (a view, or None).

    Takes what `split_snapshot` takes; numpy arrays back for a numpy `data` (a
    `dtype` numpy has: not bfloat16), tensors otherwise.

    Raises:
        InvalidArgument: a bad T, or data of the wrong type or length.
    """
    from kvstore.codec.rows import decode_swa_rows

    given = as_tensor(data, what="snapshot", wants="uint8 bytes", views=True) if isinstance(data, np.ndarray) else data
    rows, tail = split_snapshot(given, position, geometry)
    values = decode_swa_rows(rows, dtype=dtype)
    if not is_numpy(data):
        return values, tail
    ro = is_read_only(data)
    return to_numpy(values), None if tail is None else to_numpy(tail, read_only=ro)
