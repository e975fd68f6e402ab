"""A model state to and from the store's bytes: global KV blocks and SWA snapshots (through kvstore.codec).

The state's rows are the model's bytes, so nothing is transcoded: `state_blocks`
joins rows into blocks, `state_snapshot` joins window rows and the raw tail, and
`restore_state` splits them back. A restored state continues exactly as the state
it was taken from (tests/replay/model/test_cache_io.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvstore.codec.block_codec import join_blocks, split_blocks
from kvstore.codec.snapshot import join_snapshot, split_snapshot
from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from kvstore.swa_snapshot import serves
from replay.model.state import CacheState


def _ratios(geometry: ModelGeometry) -> dict[int, int]:
    return {s: geometry.compress_ratios[s] for s in geometry.kv_source_layers}


def state_blocks(geometry: ModelGeometry, state: CacheState, block_tokens: int, start_block: int = 0) -> Tensor:
    """The full blocks of global KV the state's rows hold, from block `start_block` on.

    Args:
        geometry: the model's cache geometry.
        state: the state whose rows to join.
        block_tokens: tokens per block (a multiple of the geometry's alignment).
        start_block: first block to return (blocks before it are already stored).

    Returns:
        uint8 `[n, geometry.block_bytes(block_tokens)]` on the state's device: blocks
        [start_block, rows // block) (n may be 0).

    Raises:
        InvalidArgument: a bad block size or a negative start.
    """
    size = geometry.block_bytes(block_tokens)
    if start_block < 0:
        raise InvalidArgument(f"start_block must be >= 0, got {start_block}")
    end = state.rows_coverage(_ratios(geometry)) // block_tokens
    if end <= start_block:
        return torch.empty((0, size), dtype=torch.uint8, device=state.device)
    layers = {}
    for s in geometry.kv_source_layers:
        per = geometry.block_rows(s, block_tokens)
        span = slice(start_block * per, end * per)
        layers[s] = (state.kv_rows[s][span], state.index_rows[s][span])
    return join_blocks(geometry, layers, block_tokens)


def state_snapshot(geometry: ModelGeometry, state: CacheState) -> bytes:
    """The SWA snapshot at T = state.length: every layer's window rows, then the raw tail at odd T.

    Raises:
        InvalidArgument: T = 0, a layer's window lacks rows (a state restored at T - 1 or a
            bounded replay shorter than the window holds fewer than min(T, window)), or an
            odd T without its tail.
    """
    t = state.length
    if t < 1:
        raise InvalidArgument("an empty state has no snapshot")
    n = min(t, geometry.window)
    short = [layer for layer, rows in enumerate(state.window_rows) if rows.shape[0] != n]
    if short:
        raise InvalidArgument(f"a snapshot at T = {t} needs {n} window rows per layer; layers {short} hold "
                              f"{state.window_rows[short[0]].shape[0]} (extend the state first)")
    if t % 2 and state.tail is None:
        raise InvalidArgument(f"a snapshot at odd T = {t} needs the raw tail, which this state does not hold")
    rows = torch.stack(state.window_rows)
    return join_snapshot(rows, state.tail if t % 2 else None, geometry=geometry)


def _blocks_buffer(geometry: ModelGeometry, blocks: Tensor | Sequence[bytes]) -> tuple[Tensor | bytes, int, int]:
    """(buffer split_blocks takes, blocks, block_tokens), the block size read from the data."""
    unit_bytes = geometry.block_bytes(geometry.token_alignment)
    buf: Tensor | bytes
    if isinstance(blocks, Tensor):
        if blocks.dim() != 2 or blocks.dtype != torch.uint8:
            raise InvalidArgument(f"blocks: expected a uint8 tensor [n, block_bytes], got {blocks.dtype} "
                                  f"{tuple(blocks.shape)}")
        count, size, buf = blocks.shape[0], blocks.shape[1], blocks.contiguous()
    else:
        sizes = {len(b) for b in blocks}
        if len(sizes) != 1:
            raise InvalidArgument(f"blocks: expected blocks of one size, got sizes {sorted(sizes)}")
        count, size, buf = len(blocks), sizes.pop(), b"".join(blocks)
    if size % unit_bytes:
        raise InvalidArgument(f"blocks of {size} bytes hold no whole number of {geometry.name!r} rows")
    return buf, count, size // unit_bytes * geometry.token_alignment


def restore_state(geometry: ModelGeometry, blocks: Tensor | Sequence[bytes] | None, snapshot: bytes | None, *,
                  position: int, resume: int, device: str | torch.device) -> CacheState:
    """A state at `resume` from stored bytes: loaded rows plus, when given, a snapshot's window and tail.

    Args:
        geometry: the model's cache geometry.
        blocks: blocks [0, n) of the sequence (a uint8 tensor `[n, block_bytes]`, as
            `Client.get_tensor` returns, or a list of block bytes); None for none.
            Their rows are loaded: rows_floor = the tokens they cover.
        snapshot: the SWA snapshot taken at T = `position`, or None.
        position: T of the snapshot (ignored without one).
        resume: R, the length to resume at: T or T - 1 under kvstore.swa_snapshot.serves;
            without a snapshot, the state's length (window empty), e.g. H for a replay.
        device: where the state lives.

    Returns:
        The state at R. Resuming at an odd R < T keeps no tail: the open pair's row is
        loaded and never rewritten.

    Raises:
        InvalidArgument: the snapshot does not serve R, the blocks do not hold the rows
            below R (or the open pair's row at an odd R < T), or malformed bytes.
    """
    dev = torch.device(device)
    kv_rows: dict[int, Tensor] = {}
    index_rows: dict[int, Tensor] = {}
    floor = 0
    if blocks is not None and len(blocks):
        buf, count, block_tokens = _blocks_buffer(geometry, blocks)
        for s, (kv, index) in split_blocks(geometry, buf, block_tokens).items():
            kv_rows[s] = kv.reshape(-1, kv.shape[-1]).to(dev, copy=True)
            index_rows[s] = index.reshape(-1, index.shape[-1]).to(dev, copy=True)
        floor = count * block_tokens
    else:
        for s in geometry.kv_source_layers:
            kv_rows[s] = torch.empty((0, geometry.compressed_kv_row_bytes), dtype=torch.uint8, device=dev)
            index_rows[s] = torch.empty((0, geometry.indexer_row_bytes), dtype=torch.uint8, device=dev)
    if resume < 0:
        raise InvalidArgument(f"resume must be >= 0, got {resume}")
    for s, rows in kv_rows.items():
        if rows.shape[0] < resume // geometry.compress_ratios[s]:
            raise InvalidArgument(f"a resume at {resume} needs the rows of every position below it; the blocks "
                                  f"cover {floor} tokens")
    empty = torch.empty((0, geometry.window_row_bytes), dtype=torch.uint8, device=dev)
    window = [empty.clone() for _ in range(geometry.num_layers)]
    tail = None
    if snapshot is not None:
        if not serves(geometry, position, resume):
            raise InvalidArgument(f"the snapshot at T = {position} does not serve a resume at {resume}")
        rows, snap_tail = split_snapshot(snapshot, position, geometry)
        first = position - rows.shape[1]  # position of the first row
        # Rows of [first, R): at R = T - 1 the last row goes (position T - 1 is recomputed); a window
        # of window - 1 rows is all a query at R needs ((R - window, R]).
        cut = rows[:, :resume - first]
        window = [cut[layer].to(dev, copy=True) for layer in range(geometry.num_layers)]
        if resume == position and snap_tail is not None:
            tail = snap_tail.to(dev, copy=True)
        elif resume % 2 and any(kv_rows[s].shape[0] <= (resume - 1) // 2 for s in geometry.ratio2_source_layers):
            raise InvalidArgument(f"a resume at odd {resume} from the snapshot at {position} needs the row of "
                                  f"pair ({resume - 1}, {resume}) in the blocks (the snapshot has no tail for it)")
    return CacheState(length=resume, window_rows=window, kv_rows=kv_rows, index_rows=index_rows, tail=tail,
                      rows_floor=floor)


__all__ = ["restore_state", "state_blocks", "state_snapshot"]
