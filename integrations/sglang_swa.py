"""SGLang's SWA host pages as kvstore SWA snapshots (the TRAILING_PAGES pool of HiCache).

SGLang keeps the sliding-window state of a hybrid model in its own host pool
(`PoolName.SWA`) and offloads it as the *trailing* pages of a KV prefix: a prefix of
p pages is restorable from storage when the window pages just below its end are
there (`PoolHitPolicy.TRAILING_PAGES`). kvstore keeps exactly that state as one SWA
snapshot per prompt length T (docs/SWA_POOL.md): the window rows of positions
[max(0, T - window), T) of every layer, in layer order. So the trailing pages of a
prefix ending at page p are one snapshot at T = p x page_size, keyed as the planner
keys block-boundary snapshots: `snapshot_key(anchor=chain hash of page p, [], T)`.

Page layout this adapter expects of an SWA host page (checked when the pool is
registered): `layers x page_size x window_row_bytes` bytes, layer-major, each row
the model's own window row (kvstore.codec.rows.swa_rows: 528 B on V4.1-Flash). A
snapshot of w = min(T, window) rows per layer is then w / page_size pages; page j
holds rows [j x page_size, (j + 1) x page_size) of every layer.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.client import Client
from kvstore.errors import ConfigError, KVStoreError
from kvstore.geometry import ModelGeometry
from kvstore.swa_snapshot import snapshot_key

logger = logging.getLogger(__name__)


def check_swa_page(geometry: ModelGeometry, page_size: int, page_bytes: int) -> None:
    """Refuse an SWA host pool whose pages are not whole window rows of every layer.

    Raises:
        ConfigError: the page is not layers x page_size x window_row_bytes bytes, or the
            window is not a whole number of pages.
    """
    want = geometry.num_layers * page_size * geometry.window_row_bytes
    if page_bytes != want:
        raise ConfigError(f"SGLang SWA host page is {page_bytes} B; kvstore's snapshots of {geometry.name} need "
                          f"{geometry.num_layers} layers x {page_size} tokens x {geometry.window_row_bytes} B = "
                          f"{want} B per page (layer-major window rows)")
    if geometry.window % page_size:
        raise ConfigError(f"the SWA window ({geometry.window} tokens) is not a whole number of "
                          f"{page_size}-token pages: SGLang's trailing pages cannot hold one snapshot")


def key_at(anchor: bytes, position: int, extra_keys: Sequence[str] = ()) -> bytes:
    """The kvstore snapshot key of the state at T = `position`, a page boundary whose last page is `anchor`
    (`extra_keys`: the chain's, as the planner keys snapshots)."""
    return snapshot_key(anchor, [], position, extra_keys)


def pages_for(geometry: ModelGeometry, page_size: int, position: int) -> int:
    """Trailing pages a snapshot at T = `position` fills: min(T, window) / page_size."""
    return min(position, geometry.window) // page_size


def join_pages(geometry: ModelGeometry, pages: Sequence[torch.Tensor], page_size: int) -> torch.Tensor:
    """Trailing SWA pages (flat, oldest first) as one snapshot: uint8 [layers, n x page_size, row]."""
    rows = [p.contiguous().view(torch.uint8).view(geometry.num_layers, page_size, geometry.window_row_bytes)
            for p in pages]
    return torch.cat(rows, dim=1)


def read_only(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over received bytes, without a copy, for reading only (it is copied into a
    host pool next; torch warns about a read-only buffer, which is what it is)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def split_pages(geometry: ModelGeometry, snapshot: bytes | bytearray | memoryview, page_size: int,
                n: int) -> list[torch.Tensor]:
    """A snapshot's bytes back as `n` flat uint8 pages, oldest first (read-only views, no copy)."""
    rows = read_only(snapshot).view(
        geometry.num_layers, n * page_size, geometry.window_row_bytes)
    return [rows[:, j * page_size:(j + 1) * page_size, :].reshape(-1) for j in range(n)]


def move(client: Client, geometry: ModelGeometry, pool: Any, chain: Sequence[bytes], host_indices: torch.Tensor,
         pages: int, page_size: int, *, write: bool, ttl_s: float | None, extra_keys: Sequence[str] = ()) -> bool:
    """Write the `pages` trailing SWA pages at `host_indices` as the snapshot at the end of `chain`, or
    read that snapshot into them. False (nothing half done to the store) when the pages do not fill the
    window there, the snapshot is missing, or the server fails."""
    position = len(chain) * page_size
    if pages_for(geometry, page_size, position) != pages:
        logger.warning("kvstore backend: %d trailing SWA pages asked at T=%d; a snapshot there fills %d",
                       pages, position, pages_for(geometry, page_size, position))
        return False
    key = key_at(chain[-1], position, extra_keys)

    def snapshot() -> torch.Tensor:
        flat = [pool.get_data_page(int(host_indices[i * page_size]), flat=True) for i in range(pages)]
        return join_pages(geometry, flat, page_size)

    data = _exchange(client, key, position, snapshot if write else None, ttl_s)
    if isinstance(data, bool):
        return data
    dtype = pool.get_dummy_flat_data_page().dtype
    for i, page in enumerate(split_pages(geometry, data, page_size, pages)):
        pool.set_from_flat_data_page(int(host_indices[i * page_size]), page.view(dtype))
    return True


# -- SGLang's DeepSeek-V4 SWA pool: one page per prefix end, V41 rows ------------------------------
#
# SGLang's V4 SWA host page (DeepSeekV4PagedHostPool "swa", swa_page_size = the 256-token KV page)
# is, per layer, `page_tokens` window rows: V41 rows block-split ([page x 512 B E4M3][page x 16 B
# UE8M0], SGLANG_DSV4_KV_LAYOUT=v41) or interleaved (rows of [data][scales], v41_new), or SGLang's
# default V4 rows (the sglang-v4 layout) block-split ([page x 576 B][page x 8 B], padded to 576 B).
# Slot i is position page_start + i. The window of a prefix ending at T (a page boundary) is the
# last `window` rows of the page ending at T, which is what kvstore's snapshot at T holds, row for row.


def v4_swa_item_bytes(geometry: ModelGeometry, page_tokens: int, interleaved: bool) -> int:
    """A V4 SWA host page per layer: `page_tokens` window rows, padded as SGLang's `KVLayout.page_bytes`
    does (to the data row when block-split: 149,760 B for V4's 584-B rows; none for V41's 528 B)."""
    data, scales = geometry.row_split("window")
    align = data + scales if interleaved else data
    return -(-page_tokens * (data + scales) // align) * align


def _v4_rows(geometry: ModelGeometry, page: torch.Tensor, page_tokens: int, interleaved: bool) -> torch.Tensor:
    """A V4 SWA page's rows, uint8 [layers, page_tokens, window_row_bytes] (a copy when block-split)."""
    row = geometry.window_row_bytes
    data = geometry.row_split("window")[0]  # 512 E4M3 bytes (V41), or 448 E4M3 + 64 BF16 (V4)
    flat = page.contiguous().view(torch.uint8).view(geometry.num_layers, -1)
    if interleaved:
        return flat[:, :page_tokens * row].view(-1, page_tokens, row)
    return torch.cat([flat[:, :page_tokens * data].view(-1, page_tokens, data),
                      flat[:, page_tokens * data:page_tokens * row].view(-1, page_tokens, row - data)], dim=-1)


def v4_window_of_page(geometry: ModelGeometry, page: torch.Tensor, page_tokens: int, *,
                      interleaved: bool) -> torch.Tensor:
    """The snapshot of the prefix ending with this V4 SWA page: uint8 [layers, window, row], contiguous."""
    return _v4_rows(geometry, page, page_tokens, interleaved)[:, page_tokens - geometry.window:].contiguous()


def v4_page_of_window(geometry: ModelGeometry, snapshot: bytes | bytearray | memoryview, page_tokens: int, *,
                      interleaved: bool) -> torch.Tensor:
    """The V4 SWA page ending at a snapshot's T, flat uint8: its last `window` rows from the snapshot,
    the rows before them (older than any read of the window) and the page padding zero."""
    row, data = geometry.window_row_bytes, geometry.row_split("window")[0]
    rows = torch.zeros(geometry.num_layers, page_tokens, row, dtype=torch.uint8)
    rows[:, page_tokens - geometry.window:] = read_only(snapshot).view(geometry.num_layers, geometry.window, row)
    page = torch.zeros(geometry.num_layers, v4_swa_item_bytes(geometry, page_tokens, interleaved), dtype=torch.uint8)
    if interleaved:
        page[:, :page_tokens * row] = rows.reshape(geometry.num_layers, -1)
    else:
        page[:, :page_tokens * row] = torch.cat([rows[..., :data].reshape(geometry.num_layers, -1),
                                                 rows[..., data:].reshape(geometry.num_layers, -1)], dim=1)
    return page.reshape(-1)


def move_v4(client: Client, geometry: ModelGeometry, pool: Any, chain: Sequence[bytes], host_indices: torch.Tensor,
            pages: int, page_tokens: int, *, interleaved: bool, write: bool, ttl_s: float | None,
            extra_keys: Sequence[str] = ()) -> bool:
    """The `pages` trailing V4 SWA pages at `host_indices` <-> the snapshot at the end of `chain` (page keys
    from the sequence start): written from the last page's window rows, read into the last page (the pages
    before it, older than the window, zero). False when the snapshot is missing or the server fails."""
    position = len(chain) * page_tokens
    key = key_at(chain[-1], position, extra_keys)
    last = int(host_indices[(pages - 1) * page_tokens])

    def window() -> torch.Tensor:
        return v4_window_of_page(geometry, pool.get_data_page(last, flat=True), page_tokens, interleaved=interleaved)

    data = _exchange(client, key, position, window if write else None, ttl_s)
    if isinstance(data, bool):
        return data
    for i in range(pages - 1):
        pool.set_from_flat_data_page(int(host_indices[i * page_tokens]), pool.get_dummy_flat_data_page())
    pool.set_from_flat_data_page(last, v4_page_of_window(geometry, data, page_tokens, interleaved=interleaved))
    return True


def _exchange(client: Client, key: bytes, position: int, snapshot: Callable[[], torch.Tensor] | None,
              ttl_s: float | None) -> bool | memoryview | bytes:
    """Put the snapshot `snapshot()` makes at `key` (True when stored), or, with None, get the snapshot
    stored there (its bytes; False when missing). A failed kvstore call is False, logged: a miss to SGLang."""
    try:
        if snapshot is not None:
            return client.swa.put_many([(key, position, snapshot())], ttl_s=ttl_s).stored == 1
        data = client.swa.get_many([key])[0]
    except KVStoreError as exc:
        logger.warning("kvstore SWA %s failed: %s", "put" if snapshot is not None else "get", exc)
        return False
    return False if data is None else data
