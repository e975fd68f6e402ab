"""The worker side of the vLLM connector: store blocks <-> vLLM's paged caches.

vLLM-free: it is handed the registered cache tensors, the page size of each tensor's KV
cache group, and the scheduler side's `LoadSpec`/`SaveSpec`s.

The mapping assumed (docs/ENGINES.md "vLLM: the cache layout"): a registered cache whose
name has `layers.<i>.` with `i` a kv source layer of the store's geometry holds that layer's
compressed-KV rows, or its indexer rows when the name contains "indexer"; it is
`[num_pages, page_bytes]`-shaped in bytes (any dtype, viewed as uint8; trailing padding
allowed) with `page_tokens // ratio` rows per page, token-contiguous, each row the model's own
`[data][scales]` bytes (docs/CODEC.md). Other caches (window/SWA, non-source layers) are left
alone. A store block's sections (`geometry.block_layout`) are copied row-run by row-run.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from integrations.common import PageMap, StoreSettings, fetch_blocks
from integrations.vllm_scheduler import LoadSpec, SaveSpec
from kvstore.client import Client
from kvstore.codec.snapshot import join_snapshot, split_snapshot
from kvstore.errors import ConfigError
from kvstore.geometry import ModelGeometry, Section

log = logging.getLogger(__name__)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class _Target:
    """One block section's destination: a registered cache, its page map, its group."""

    section: Section
    name: str
    cache: torch.Tensor
    pages: PageMap
    group: int


def map_caches(geometry: ModelGeometry, block_tokens: int, caches: Mapping[str, torch.Tensor],
               groups: Mapping[str, tuple[int, int]]) -> list[_Target]:
    """The destination of every section of a store block among vLLM's registered caches.

    Args:
        groups: layer name -> (KV cache group index, tokens per page of that group).

    Raises:
        ConfigError: a section without a cache, or two caches for one section.
    """
    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for name, cache in caches.items():
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) not in geometry.kv_source_layers:
            continue
        component = "indexer" if "indexer" in name else "compressed_kv"
        if "window" in name or "swa" in name:
            continue
        key = (int(m.group(1)), component)
        if key in found:
            raise ConfigError(f"two vLLM caches hold layer {key[0]}'s {component} rows: {found[key][0]!r} and "
                              f"{name!r} (docs/ENGINES.md: the cache layout)")
        found[key] = (name, cache)
    targets: list[_Target] = []
    missing = []
    for s in geometry.block_layout(block_tokens):
        hit = found.get((s.layer, s.component))
        if hit is None:
            missing.append(f"layer {s.layer} {s.component}")
            continue
        name, cache = hit
        if name not in groups:
            raise ConfigError(f"vLLM cache {name!r} is in no KV cache group of the kv_cache_config")
        group, page_tokens = groups[name]
        ratio = geometry.compress_ratios[s.layer]
        if page_tokens % ratio:
            raise ConfigError(f"vLLM pages of {page_tokens} tokens do not hold whole rows of layer {s.layer} "
                              f"(one per {ratio} tokens)")
        pages = PageMap(page_tokens=page_tokens, ratio=ratio, row_bytes=s.row_bytes)
        pages.view(cache)  # checks the page holds its rows
        targets.append(_Target(section=s, name=name, cache=cache, pages=pages, group=group))
    if missing:
        raise ConfigError(f"no vLLM cache for {', '.join(missing)} of geometry {geometry.name!r} among "
                          f"{sorted(caches)} (names need 'layers.<i>.', indexer caches 'indexer')")
    return targets


def has_windows(num_layers: int, names: Iterable[str]) -> bool:
    """Whether `names` (vLLM's cache layer names) hold a window cache for every layer (see `map_windows`)."""
    layers = set()
    for name in names:
        m = _LAYER.search(name)
        if m is not None and ("window" in name or "swa" in name):
            layers.add(int(m.group(1)))
    return layers == set(range(num_layers))


def map_windows(geometry: ModelGeometry, caches: Mapping[str, torch.Tensor],
                groups: Mapping[str, tuple[int, int]]) -> dict[int, tuple[torch.Tensor, PageMap, int]] | None:
    """Every layer's window (SWA) cache: name with `layers.<i>.` and `window` or `swa`, one row of
    `window_row_bytes` per token in position order. None unless every layer has one (no snapshots then)."""
    found: dict[int, tuple[torch.Tensor, PageMap, int]] = {}
    for name, cache in caches.items():
        m = _LAYER.search(name)
        if m is None or not ("window" in name or "swa" in name) or name not in groups:
            continue
        group, page_tokens = groups[name]
        pages = PageMap(page_tokens=page_tokens, ratio=1, row_bytes=geometry.window_row_bytes)
        pages.view(cache)
        found[int(m.group(1))] = (cache, pages, group)
    return found if sorted(found) == list(range(geometry.num_layers)) else None


class WorkerSide:
    """Loads and saves of the worker-side connector.

    Args:
        client: the store's client.
        settings: the adapter's settings (load path).
        geometry: the store's geometry; `block_tokens` its block size.
        reader: a `ColocatedReader` for the direct paths, or None.
    """

    def __init__(self, client: Client, settings: StoreSettings, geometry: ModelGeometry, *,
                 reader: Any = None) -> None:
        self.client, self.settings, self.geometry, self.reader = client, settings, geometry, reader
        self.block_tokens = client.block_tokens
        self.targets: list[_Target] = []
        #: layer -> (window cache, its page map, its group); None: no snapshots (not every layer has one).
        self.windows: dict[int, tuple[torch.Tensor, PageMap, int]] | None = None
        #: Snapshots put, and those skipped because vLLM had already freed part of the window.
        self.snapshots_saved = 0
        self.snapshots_skipped = 0
        self.snapshots_loaded = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")
        self._lock = threading.Lock()
        self._saving: dict[str, list[Future[Any]]] = {}
        self._ended: set[str] = set()
        #: Per running request, the snapshot at its output's latest block boundary (put when it ends).
        self._kept: dict[str, tuple[list[int], int, bytes, tuple[str, ...]]] = {}
        self._load_errors: set[int] = set()
        self._recved: set[str] = set()
        self._failed_recv: set[str] = set()
        #: Counters: blocks loaded, blocks put (written or already there), failed puts, loads by path.
        self.blocks_loaded = 0
        self.blocks_saved = 0
        self.save_errors = 0
        self.load_paths: Counter[str] = Counter()

    def register(self, caches: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[int, int]]) -> None:
        """`register_kv_caches`: find where each block section goes."""
        self.targets = map_caches(self.geometry, self.block_tokens, caches, groups)
        self.windows = map_windows(self.geometry, caches, groups)

    # -- loads -------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> None:
        """Fill positions [spec.start, spec.end) from the store; what fails is recorded for vLLM."""
        b = self.block_tokens
        covered = spec.start
        try:
            device = self.targets[0].cache.device if self.targets else "cpu"
            blocks, n, path = fetch_blocks(self.client, spec.hashes, self.settings, self.reader, device)
            self.load_paths[path] += 1
            covered = max(min(n * b, spec.end), spec.start)
            if spec.snapshot_at is not None and not self._load_window(spec):
                covered = spec.start   # without its window the resume point is no use: vLLM recomputes
            if covered > spec.start:
                self._scatter(blocks[:-(-covered // b)], spec, spec.start, covered)
                self.blocks_loaded += -(-covered // b) - spec.start // b
        except Exception as exc:  # a failed load is recomputed by vLLM, never fatal
            log.warning("kvstore: load of request %s failed from token %d: %s", spec.req_id, covered, exc)
        finally:
            if spec.lease_id:
                try:
                    self.client.release(spec.lease_id)
                except Exception as exc:  # the lease lapses on its own
                    log.debug("kvstore: lease release failed: %s", exc)
        if covered < spec.end:
            log.warning("kvstore: request %s: tokens [%d, %d) not loaded; vLLM recomputes them",
                        spec.req_id, covered, spec.end)
            if spec.asynchronous:
                self._failed_recv.add(spec.req_id)
            else:
                self._load_errors |= self._pages_of(spec, covered, spec.end)
        if spec.asynchronous:
            self._recved.add(spec.req_id)

    def _load_window(self, spec: LoadSpec) -> bool:
        """Fill the window pages of [T - window, T) (those at or above vLLM's own hit) from the snapshot
        at T; False when it is gone or there are no window caches."""
        at, key = spec.snapshot_at, spec.snapshot_key
        if self.windows is None or at is None or key is None:
            return False
        data = self.client.swa.get_many([key])[0]
        if data is None:
            return False
        rows, _ = split_snapshot(data, at, self.geometry)
        first = max(at - rows.shape[1], spec.start)
        for layer in range(self.geometry.num_layers):
            cache, pages, group = self.windows[layer]
            page, slot = pages.slots(spec.block_ids[group], first, at - first)
            keep = page != 0   # vLLM's null block: a page it did not allocate (out of the window)
            view = pages.view(cache)
            part = rows[layer, first - (at - rows.shape[1]):].to(view.device)
            view[page[keep].to(view.device), slot[keep].to(view.device)] = part[keep.to(view.device)]
        self.snapshots_loaded += 1
        return True

    def _pages_of(self, spec: LoadSpec | SaveSpec, start: int, end: int) -> set[int]:
        ids: set[int] = set()
        for t in self.targets:
            p = t.pages.page_tokens
            ids.update(spec.block_ids[t.group][start // p: -(-end // p)])
        return ids

    def _scatter(self, blocks: torch.Tensor, spec: LoadSpec, start: int, end: int) -> None:
        for t in self.targets:
            s, r = t.section, t.pages.ratio
            rows = blocks[:, s.offset: s.offset + s.size_bytes].reshape(-1, s.row_bytes)
            first, last = start // r, end // r
            page, slot = t.pages.slots(spec.block_ids[t.group], first, last - first)
            view = t.pages.view(t.cache)
            view[page.to(view.device), slot.to(view.device)] = rows[first:last].to(view.device)

    def take_load_errors(self) -> set[int]:
        """`get_block_ids_with_load_errors`: vLLM block ids of failed synchronous loads (then cleared)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------

    def gather(self, spec: SaveSpec) -> torch.Tensor:
        """The store blocks [first_block, len(tokens) // block_tokens) of a request, from its pages."""
        b = self.block_tokens
        first, count = spec.first_block, len(spec.tokens) // b - spec.first_block
        out = torch.empty((count, self.client.block_bytes), dtype=torch.uint8)
        for t in self.targets:
            s, r = t.section, t.pages.ratio
            lo, hi = first * b // r, (first + count) * b // r
            page, slot = t.pages.slots(spec.block_ids[t.group], lo, hi - lo)
            view = t.pages.view(t.cache)
            rows = view[page.to(view.device), slot.to(view.device)].cpu()
            out[:, s.offset: s.offset + s.size_bytes] = rows.reshape(count, s.size_bytes)
        return out

    def window(self, spec: SaveSpec, position: int) -> bytes | None:
        """The snapshot at T = `position` from the window pages (`kvstore.codec.snapshot`), or None
        when vLLM already freed a page of [T - window, T) (its null block, id 0)."""
        if self.windows is None:
            return None
        n = min(position, self.geometry.window)
        rows = []
        for layer in range(self.geometry.num_layers):
            cache, pages, group = self.windows[layer]
            ids = spec.block_ids[group]
            first, last = (position - n) // pages.page_tokens, (position - 1) // pages.page_tokens
            if last >= len(ids) or any(ids[i] == 0 for i in range(first, last + 1)):
                return None
            page, slot = pages.slots(ids, position - n, n)
            view = pages.view(cache)
            rows.append(view[page.to(view.device), slot.to(view.device)].cpu())
        return join_snapshot(torch.stack(rows), None, geometry=self.geometry)

    def save(self, spec: SaveSpec) -> None:
        """Copy the new blocks (and the snapshot, if asked and still in the pages) out now; put them
        on the save thread."""
        blocks = self.gather(spec)
        snapshot = None if spec.snapshot_at is None else self.window(spec, spec.snapshot_at)
        if spec.snapshot_at is not None and snapshot is None:
            self.snapshots_skipped += 1
        if snapshot is not None and spec.snapshot_at_end and spec.snapshot_at is not None:
            # The output's latest boundary: put when the request ends, unless a later one replaces it.
            with self._lock:
                self._kept[spec.req_id] = (spec.tokens[: spec.snapshot_at], spec.snapshot_at, snapshot,
                                           spec.extra_keys)
            snapshot = None

        def put() -> None:
            try:
                if len(blocks):
                    self.client.put(spec.tokens, blocks, first_block=spec.first_block, extra_keys=spec.extra_keys)
                    self.blocks_saved += len(blocks)
                if snapshot is not None and spec.snapshot_at is not None:
                    self.client.swa.put(spec.tokens[: spec.snapshot_at], snapshot, position=spec.snapshot_at,
                                        extra_keys=spec.extra_keys)
                    self.snapshots_saved += 1
            except Exception as exc:  # a failed save is a future miss, never an engine failure
                self.save_errors += 1
                log.warning("kvstore: saving blocks %d.. of request %s failed: %s", spec.first_block,
                            spec.req_id, exc)

        with self._lock:
            self._saving.setdefault(spec.req_id, []).append(self._pool.submit(put))

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """`get_finished`: requests whose saves are all done (of those vLLM ended), and loads done."""
        with self._lock:
            for r in finished_req_ids:
                kept = self._kept.pop(r, None)
                if kept is not None:
                    self._saving.setdefault(r, []).append(self._pool.submit(self._put_snapshot, *kept))
            self._ended.update(r for r in finished_req_ids if r in self._saving)
            done = {r for r in self._ended if all(f.done() for f in self._saving[r])}
            for r in done:
                self._ended.discard(r)
                del self._saving[r]
        recved, self._recved = self._recved, set()
        return done or None, recved or None

    def _put_snapshot(self, tokens: list[int], position: int, snapshot: bytes, keys: tuple[str, ...]) -> None:
        try:
            self.client.swa.put(tokens, snapshot, position=position, extra_keys=keys)
            self.snapshots_saved += 1
        except Exception as exc:  # a failed save is a future miss
            self.save_errors += 1
            log.warning("kvstore: saving the snapshot at %d failed: %s", position, exc)

    def take_failed_recving(self) -> set[str]:
        """Requests whose asynchronous load failed (vLLM recomputes them), then cleared."""
        failed, self._failed_recv = self._failed_recv, set()
        return failed

    def close(self) -> None:
        """Wait for the puts in flight, then close the client."""
        self._pool.shutdown(wait=True)
        self.client.close()
