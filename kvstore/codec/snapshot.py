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
"""

from __future__ import annotations

import torch

from kvstore.codec.block_codec import as_uint8
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH, ModelGeometry
from kvstore.swa_snapshot import SnapshotShape, check_position, snapshot_bytes, snapshot_shape


def _shape_of(x: object) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_window_rows(rows: object, shape: SnapshotShape, geometry: ModelGeometry) -> torch.Tensor:
    if (not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 3
            or rows.shape[0] != shape.layers or rows.shape[2] != shape.row_bytes
            or not 1 <= rows.shape[1] <= shape.window):
        got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise InvalidArgument(f"snapshot window rows: expected uint8 [{shape.layers}, n, {shape.row_bytes}] "
                              f"with 1 <= n <= {shape.window} (geometry {geometry.name!r}), got {got}")
    return rows


def _check_tail(tail: object, shape: SnapshotShape, geometry: ModelGeometry) -> torch.Tensor:
    expected = (len(shape.ratio2_layers), 2, shape.tail_channels)
    if not isinstance(tail, torch.Tensor) or tail.dtype != torch.float32 or tuple(tail.shape) != expected:
        got = f"{tail.dtype} {tuple(tail.shape)}" if isinstance(tail, torch.Tensor) else type(tail).__name__
        raise InvalidArgument(f"snapshot tail: expected float32 {list(expected)} [ratio-2 source layers "
                              f"{list(shape.ratio2_layers)}, kv/score, head_dim] (geometry {geometry.name!r}), "
                              f"got {got}")
    if not bool(torch.isfinite(tail).all()):
        raise InvalidArgument("snapshot tail holds NaN or Inf")
    return tail


def _host_bytes(x: torch.Tensor) -> bytes:
    raw: bytes = x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return raw


def join_snapshot(window_rows: torch.Tensor, tail: torch.Tensor | None, *,
                  geometry: ModelGeometry = V4_1_FLASH) -> bytes:
    """The bytes of one snapshot: its window rows, then its raw tail when there is one.

    Args:
        window_rows: uint8 `[layers, n, window_row_bytes]` (`[40, n, 528]` for V4.1-Flash),
            n = min(T, window): the rows of positions [T - n, T) of every layer, any device.
        tail: float32 `[ratio-2 source layers, 2, head_dim]` (`[3, 2, 512]`): each ratio-2
            source layer's last-token kv then gate score, when T is odd; None when T is even.
        geometry: sizes the snapshot.

    Returns:
        The snapshot bytes (host memory), `kvstore.swa_snapshot.snapshot_bytes(geometry, T)` long.

    Raises:
        InvalidArgument: a wrong dtype or shape; NaN or Inf in the tail; a tail with
            fewer than a full window of rows only fits an odd n (T = n < window).
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
    return _host_bytes(rows) + _host_bytes(tail.to(torch.float32))


def split_snapshot(data: object, position: int, geometry: ModelGeometry = V4_1_FLASH
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The window rows and raw tail of a snapshot at T = `position`, as views of `data` (no copy).

    Args:
        data: bytes, bytearray, memoryview or a 1-D contiguous uint8 tensor of
            `snapshot_bytes(geometry, T)`.
        position: T, the prompt length the snapshot was taken at.
        geometry: sizes the snapshot.

    Returns:
        `(window_rows, tail)`: uint8 `[layers, min(T, window), window_row_bytes]`, and
        float32 `[ratio-2 source layers, 2, head_dim]` when T is odd, else None. They
        alias `data`: valid while `data` is alive and unchanged, and not to be
        written to when `data` is read-only.

    Raises:
        InvalidArgument: a bad T, or data of the wrong type or length.
    """
    t = check_position(position)
    shape = snapshot_shape(geometry)
    buf = as_uint8(data, expected_bytes=snapshot_bytes(geometry, t), what=f"SWA snapshot at T = {t}")
    n = shape.window_positions(t)
    split = shape.layers * n * shape.row_bytes
    rows = buf[:split].view(shape.layers, n, shape.row_bytes)
    if not t % 2:
        return rows, None
    tail = buf[split:].view(torch.float32).view(len(shape.ratio2_layers), 2, shape.tail_channels)
    return rows, tail


def encode_snapshot(window: torch.Tensor, tail: torch.Tensor | None, *,
                    geometry: ModelGeometry = V4_1_FLASH) -> bytes:
    """A snapshot from float window KV: `swa_rows` of every row, joined with the tail.

    Args:
        window: float `[layers, n, head_dim]`, the window KV of positions [T - n, T),
            on any device (the rows are quantized there).
        tail: as in `join_snapshot`.
        geometry: sizes the snapshot.

    Raises:
        InvalidArgument: a wrong shape or dtype; NaN or Inf.
    """
    from kvstore.codec.rows import swa_rows

    shape = snapshot_shape(geometry)
    if not isinstance(window, torch.Tensor) or window.dim() != 3 or window.shape[0] != shape.layers \
            or window.shape[2] != shape.tail_channels:
        raise InvalidArgument(f"snapshot window: expected a float tensor [{shape.layers}, n, "
                              f"{shape.tail_channels}] (geometry {geometry.name!r}), got {_shape_of(window)}")
    return join_snapshot(swa_rows(window), tail, geometry=geometry)


def decode_snapshot(data: object, position: int, geometry: ModelGeometry = V4_1_FLASH, *,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The window KV `[layers, min(T, window), head_dim]` of `dtype` and the raw tail (a view, or None).

    Raises:
        InvalidArgument: a bad T, or data of the wrong type or length.
    """
    from kvstore.codec.rows import decode_swa_rows

    rows, tail = split_snapshot(data, position, geometry)
    return decode_swa_rows(rows, dtype=dtype), tail
