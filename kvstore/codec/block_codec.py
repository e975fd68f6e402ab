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
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry

#: Tokens per block unless told otherwise (the server's default `store.block_tokens`).
BLOCK_TOKENS = 64

#: Per source layer: (compressed-KV rows, indexer rows).
LayerRows = Mapping[int, tuple[torch.Tensor, torch.Tensor]]


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
    """`x` as `[n, rows, width]`, from `[n * rows, width]` or `[n, rows, width]`."""
    shape = f"[n * {rows}, {width}] or [n, {rows}, {width}]"
    kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"{what}: expected a {kinds} tensor {shape}, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise InvalidArgument(f"{what}: expected {kinds}, got {x.dtype}")
    ok = ((x.dim() == 2 and x.shape[0] % rows == 0) or (x.dim() == 3 and x.shape[1] == rows)) \
        and x.shape[-1] == width
    if not ok:
        raise InvalidArgument(f"{what}: expected shape {shape}, got {tuple(x.shape)}")
    return x.reshape(-1, rows, width)


def _gather(geometry: ModelGeometry, layers: object, block_tokens: int, *, dtypes: tuple[torch.dtype, ...],
            widths: tuple[int, int]) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Check every layer's pair; return the block count and `[n, rows, width]` tensors."""
    geometry.check_block_tokens(block_tokens)
    checked = _check_layers(geometry, layers)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    counts: set[int] = set()
    devices: set[torch.device] = set()
    for layer in geometry.kv_source_layers:
        rows = geometry.block_rows(layer, block_tokens)
        kv, index = _pair(layer, checked[layer])
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
    return counts.pop(), out


def _row_widths(geometry: ModelGeometry) -> tuple[int, int]:
    return geometry.compressed_kv_row_bytes, geometry.indexer_row_bytes


def join_blocks(geometry: ModelGeometry, layers: LayerRows, block_tokens: int = BLOCK_TOKENS, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Build `n` blocks from per-layer row tensors, one copy per section for all blocks.

    Args:
        geometry: the model's cache geometry.
        layers: for each source layer, `(kv_rows, index_rows)`: uint8 tensors of
            `[n * rows, row_bytes]` (rows of consecutive blocks follow each other,
            in position order) or `[n, rows, row_bytes]`, where rows is
            `block_tokens / compress_ratio` (32 or 64 for V4.1-Flash 64-token
            blocks) and row_bytes 288 (compressed KV) or 68 (indexer). All on one device.
        block_tokens: tokens per block, a multiple of geometry.token_alignment.
        out: where to write, a uint8 `[n, block_bytes]` tensor on the rows'
            device whose rows are contiguous (e.g. pinned memory); new memory if None.

    Returns:
        uint8 `[n, geometry.block_bytes(block_tokens)]`, ready for `Client.put`.

    Raises:
        InvalidArgument: a missing or extra layer, a wrong dtype, width or row
            count, layers of different block counts, or a bad `out`.
    """
    n, rows3 = _gather(geometry, layers, block_tokens, dtypes=_ROWS, widths=_row_widths(geometry))
    size = geometry.block_bytes(block_tokens)
    device = rows3[geometry.kv_source_layers[0]][0].device
    if out is None:
        out = torch.empty((n, size), dtype=torch.uint8, device=device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (n, size)
          or out.stride(-1) != 1 or out.device != device):
        got = (f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise InvalidArgument(f"out: expected a uint8 tensor [{n}, {size}] on {device} with contiguous rows, got {got}")
    for s in geometry.block_layout(block_tokens):
        src = rows3[s.layer][0 if s.component == "compressed_kv" else 1]
        out[:, s.offset:s.offset + s.size_bytes].view(n, s.rows, s.row_bytes).copy_(src)
    return out


def join_block(geometry: ModelGeometry, layers: LayerRows, block_tokens: int = BLOCK_TOKENS) -> torch.Tensor:
    """One block from per-layer rows: `{layer: (kv_rows[rows, 288], index_rows[rows, 68])}`.

    Returns:
        uint8 `[geometry.block_bytes(block_tokens)]` on the rows' device;
        `bytes(t.cpu().numpy())` when bytes are wanted.

    Raises:
        InvalidArgument: as `join_blocks`, or rows for more than one block.
    """
    n, _ = _gather(geometry, layers, block_tokens, dtypes=_ROWS, widths=_row_widths(geometry))
    if n != 1:
        raise InvalidArgument(f"join_block takes the rows of one block of {block_tokens} tokens; "
                              f"these hold {n} (use join_blocks)")
    return join_blocks(geometry, layers, block_tokens)[0]


def split_block(geometry: ModelGeometry, block: object,
                block_tokens: int = BLOCK_TOKENS) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The rows of one block, as views of it (no copy): the inverse of `join_block`.

    Args:
        geometry: the model's cache geometry.
        block: bytes, bytearray, memoryview or a 1-D contiguous uint8 tensor (CPU
            or CUDA) of `geometry.block_bytes(block_tokens)`.
        block_tokens: tokens in the block.

    Returns:
        Source layer -> `(kv_rows[rows, 288], index_rows[rows, 68])`, uint8,
        contiguous. Every tensor aliases `block`: valid while it is alive and
        unchanged (for a buffer lent by LMDB, only until its transaction ends),
        and not to be written to when `block` is read-only (bytes).

    Raises:
        InvalidArgument: wrong type or length, or a block size the geometry cannot hold.
    """
    buf = as_uint8(block, expected_bytes=geometry.block_bytes(block_tokens), what="block")
    parts: dict[tuple[int, str], torch.Tensor] = {}
    for s in geometry.block_layout(block_tokens):
        parts[s.layer, s.component] = buf[s.offset:s.offset + s.size_bytes].view(s.rows, s.row_bytes)
    return {layer: (parts[layer, "compressed_kv"], parts[layer, "indexer"]) for layer in geometry.kv_source_layers}


def split_blocks(geometry: ModelGeometry, blocks: object,
                 block_tokens: int = BLOCK_TOKENS) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The rows of `n` blocks, as views (no copy): the inverse of `join_blocks`.

    Args:
        geometry: the model's cache geometry.
        blocks: a uint8 tensor `[n, block_bytes]` whose rows are contiguous (what
            `Client.get_tensor` returns), or one buffer of `n * block_bytes` as
            `split_block` takes it.
        block_tokens: tokens per block.

    Returns:
        Source layer -> `(kv_rows[n, rows, 288], index_rows[n, rows, 68])`,
        uint8 views of `blocks` (strided across blocks: `.reshape(-1, 288)` copies).

    Raises:
        InvalidArgument: wrong type, dtype, shape or length.
    """
    size = geometry.block_bytes(block_tokens)
    if isinstance(blocks, torch.Tensor) and blocks.dim() == 2:
        if blocks.dtype != torch.uint8 or blocks.shape[1] != size or blocks.stride(1) != 1:
            raise InvalidArgument(f"blocks: expected a uint8 tensor [n, {size}] with contiguous rows, "
                                  f"got {blocks.dtype} of shape {tuple(blocks.shape)}")
        grid = blocks
    else:
        length = _length(blocks)
        if length is None or length % size:
            raise InvalidArgument(f"blocks: expected a whole number of {size}-byte blocks, got "
                                  f"{type(blocks).__name__ if length is None else f'{length} bytes'}")
        grid = as_uint8(blocks, expected_bytes=length, what="blocks").view(-1, size)
    n = grid.shape[0]
    parts: dict[tuple[int, str], torch.Tensor] = {}
    for s in geometry.block_layout(block_tokens):
        parts[s.layer, s.component] = grid[:, s.offset:s.offset + s.size_bytes].view(n, s.rows, s.row_bytes)
    return {layer: (parts[layer, "compressed_kv"], parts[layer, "indexer"]) for layer in geometry.kv_source_layers}


def _length(data: object) -> int | None:
    if isinstance(data, torch.Tensor):
        return data.numel() if data.dim() == 1 else None
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).nbytes
    return None


# -- float tensors <-> blocks, with the model's quantization ------------------------

def encode_blocks(geometry: ModelGeometry, layers: LayerRows, block_tokens: int = BLOCK_TOKENS) -> torch.Tensor:
    """Quantize per-layer float tensors to the model's rows and build `n` blocks.

    Args:
        layers: for each source layer, `(kv[n * rows, head_dim], index_key[n * rows,
            index_head_dim])` (or `[n, rows, ...]`), float32, bfloat16 or float16,
            on one device: the compressor's output and the indexer's keys.

    Returns:
        uint8 `[n, block_bytes]` on the tensors' device.

    Raises:
        InvalidArgument: as `join_blocks`; NaN or Inf.
    """
    from kvstore.codec import rows

    _, values = _gather(geometry, layers, block_tokens, dtypes=_VALUES,
                        widths=(geometry.head_dim, geometry.index_head_dim))
    quantized = {layer: (rows.compressed_kv_rows(kv), rows.indexer_key_rows(index))
                 for layer, (kv, index) in values.items()}
    return join_blocks(geometry, quantized, block_tokens)


def encode_block(geometry: ModelGeometry, layers: LayerRows, block_tokens: int = BLOCK_TOKENS) -> torch.Tensor:
    """One block from per-layer float tensors `{layer: (kv[rows, head_dim], index_key[rows, index_head_dim])}`.

    Returns:
        uint8 `[block_bytes]` on the tensors' device.
    """
    data = encode_blocks(geometry, layers, block_tokens)
    if data.shape[0] != 1:
        raise InvalidArgument(f"encode_block takes the values of one block of {block_tokens} tokens; "
                              f"these hold {data.shape[0]} (use encode_blocks)")
    return data[0]


def decode_blocks(geometry: ModelGeometry, blocks: object, block_tokens: int = BLOCK_TOKENS, *,
                  dtype: torch.dtype = torch.float32) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Dequantize `n` blocks: source layer -> `(kv[n, rows, head_dim], index_key[n, rows, index_head_dim])`.

    Exact (code times scale) in float32; new memory, on the blocks' device.
    """
    from kvstore.codec import rows

    return {layer: (rows.decode_compressed_kv_rows(kv, dtype=dtype), rows.decode_indexer_key_rows(index, dtype=dtype))
            for layer, (kv, index) in split_blocks(geometry, blocks, block_tokens).items()}


def decode_block(geometry: ModelGeometry, block: object, block_tokens: int = BLOCK_TOKENS, *,
                 dtype: torch.dtype = torch.float32) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Dequantize one block: source layer -> `(kv[rows, head_dim], index_key[rows, index_head_dim])`."""
    from kvstore.codec import rows

    return {layer: (rows.decode_compressed_kv_rows(kv, dtype=dtype), rows.decode_indexer_key_rows(index, dtype=dtype))
            for layer, (kv, index) in split_block(geometry, block, block_tokens).items()}


def as_uint8(data: object, *, expected_bytes: int, what: str) -> torch.Tensor:
    """`data` as a 1-D uint8 tensor sharing its memory, after checking its length.

    Args:
        data: bytes, bytearray, memoryview (C-contiguous) or 1-D contiguous uint8 tensor.
        expected_bytes: the length it must have.
        what: how messages name it.

    Returns:
        A view of `data`, on data's device for a tensor, on the CPU otherwise. It
        keeps `data` alive but not whatever lent `data` (an LMDB transaction).

    Raises:
        InvalidArgument: wrong type, dtype, layout or length.
    """
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise InvalidArgument(f"{what}: expected a 1-D contiguous uint8 tensor, got {data.dtype} "
                                  f"of shape {tuple(data.shape)}")
        buf = data
    elif isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        if not view.c_contiguous:
            raise InvalidArgument(f"{what}: expected a contiguous buffer")
        if view.nbytes != expected_bytes:
            raise InvalidArgument(f"{what}: expected {expected_bytes} bytes, got {view.nbytes}")
        if not view.nbytes:  # torch.frombuffer refuses an empty buffer; there is nothing to share
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # bytes are read-only; torch warns that writing to the tensor would be
            # undefined. The contract above forbids writing instead.
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    else:
        raise InvalidArgument(f"{what}: expected bytes, bytearray, memoryview or a uint8 tensor, "
                              f"got {type(data).__name__}")
    if buf.numel() != expected_bytes:
        raise InvalidArgument(f"{what}: expected {expected_bytes} bytes, got {buf.numel()}")
    return buf
