"""The vLLM worker side's saves: new full blocks (and window snapshots) out of vLLM's paged caches.

vLLM-free. A save's rows are copied out of the pages in the step that computes them: per layer
right after the layer wrote them (`save_layer`, with `layerwise`; `integrations.vllm_layers.
copy_out`), the rest at the step's end (`save_step`). A store block's sections
(`geometry.block_layout`) are copied row-run by row-run. The puts run on one save thread, chained
to the blocks before; a request is reported finished once its puts are done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from integrations.common import PageMap
from integrations.vllm_caches import CacheMap, CacheTarget
from integrations.vllm_layers import Capture, SideStream, copy_out, layer_of
from integrations.vllm_scheduler import SaveSpec
from kvstore.client import Client
from kvstore.codec.snapshot import join_snapshot
from kvstore.geometry import ModelGeometry

log = logging.getLogger(__name__)

#: A part of a save copied out per layer: ("section", layer, component) or ("window", layer, "").
Part = tuple[str, int, str]


class Saver:
    """The saves of the worker-side connector.

    Args:
        client: the store's client.
        geometry: the store's geometry (its window, for snapshots).
    """

    def __init__(self, client: Client, geometry: ModelGeometry) -> None:
        self.client, self.geometry = client, geometry
        self.block_tokens = client.block_tokens
        #: Where the rows are (set when vLLM registers its caches).
        self.caches = CacheMap()
        #: Counters: blocks put (written or already there), failed puts; snapshots put, and those
        #: skipped because vLLM had already freed part of the window.
        self.blocks_saved = 0
        self.save_errors = 0
        self.snapshots_saved = 0
        self.snapshots_skipped = 0
        #: Parts of saves (a section or a window layer) copied out per layer, and gathered at the step's end.
        self.parts_captured = 0
        self.parts_gathered = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")
        self._lock = threading.Lock()
        self._saving: dict[str, list[Future[Any]]] = {}
        self._ended: set[str] = set()
        #: Per running request, the snapshot at its output's latest block boundary (put when it ends).
        self._kept: dict[str, tuple[list[int], int, bytes, tuple[str, ...]]] = {}
        #: The pins Puts asked by a request's retention hint were granted, not yet reported: req id ->
        #: (time granted, 0: none; why less) (`take_granted`, to the scheduler side).
        self._granted: dict[str, tuple[float, str]] = {}
        self._stream = SideStream()
        self._captured: dict[tuple[int, str, int, str], Capture] = {}
        self._capture_for: Sequence[SaveSpec] | None = None

    def _section_slots(self, t: CacheTarget, spec: SaveSpec) -> tuple[torch.Tensor, torch.Tensor]:
        b, r = self.block_tokens, t.pages.ratio
        first, count = spec.first_block, len(spec.tokens) // b - spec.first_block
        lo, hi = first * b // r, (first + count) * b // r
        return t.pages.slots(spec.block_ids[t.group], lo, hi - lo)

    def _window_slots(self, spec: SaveSpec, position: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where layer `layer`'s window rows of [T - window, T) are, T = `position`; None when vLLM
        already freed one of their pages (its null block, id 0)."""
        assert self.caches.windows is not None
        n = min(position, self.geometry.window)
        _, pages, group = self.caches.windows[layer]
        ids = spec.block_ids[group]
        first, last = (position - n) // pages.page_tokens, (position - 1) // pages.page_tokens
        if last >= len(ids) or any(ids[i] == 0 for i in range(first, last + 1)):
            return None
        return pages.slots(ids, position - n, n)

    def save_layer(self, specs: Sequence[SaveSpec], name: str) -> None:
        """`save_kv_layer`: copy the rows of `name`'s layer that `specs` save out of the pages now, right
        after the layer wrote them (on CUDA: a gather on the current stream, then an asynchronous copy
        to pinned host memory); `save_step` takes them instead of gathering them again."""
        layer, windows = layer_of(name), self.caches.windows
        if layer is None or not specs:
            return
        if self._capture_for is not specs:   # a new step's saves
            self._captured, self._capture_for = {}, specs
        for i, spec in enumerate(specs):
            if len(spec.tokens) // self.block_tokens > spec.first_block:
                for t in self.caches.targets:
                    key = (i, "section", layer, t.section.component)
                    if t.section.layer == layer and key not in self._captured:
                        page, slot = self._section_slots(t, spec)
                        self._captured[key] = self._copy_out(t.cache, t.pages, page, slot)
            key = (i, "window", layer, "")
            if spec.snapshot_at is not None and windows is not None and layer in windows and key not in self._captured:
                slots = self._window_slots(spec, spec.snapshot_at, layer)
                if slots is not None:
                    cache, pages, _ = windows[layer]
                    self._captured[key] = self._copy_out(cache, pages, *slots)

    def _copy_out(self, cache: torch.Tensor, pages: PageMap, page: torch.Tensor, slot: torch.Tensor) -> Capture:
        view = pages.view(cache)
        stream = self._stream.on(view.device) if view.device.type == "cuda" else None
        self.parts_captured += 1
        return copy_out(view, page, slot, stream)

    def save_step(self, specs: Sequence[SaveSpec]) -> None:
        """`wait_for_save`: each spec's blocks (and snapshot) from the rows `save_layer` copied out,
        the rest gathered now, put on the save thread."""
        captured = self._captured if self._capture_for is specs else {}
        self._captured, self._capture_for = {}, None
        for i, spec in enumerate(specs):
            mine = {key[1:]: part for key, part in captured.items() if key[0] == i}
            self.save(spec, mine)

    def gather(self, spec: SaveSpec, captured: Mapping[Part, Capture] | None = None) -> torch.Tensor:
        """The store blocks [first_block, len(tokens) // block_tokens) of a request, from its pages (or
        from the rows `save_layer` copied out: `captured`)."""
        b = self.block_tokens
        count = len(spec.tokens) // b - spec.first_block
        out = torch.empty((count, self.client.block_bytes), dtype=torch.uint8)
        for t in self.caches.targets if count > 0 else ():
            s = t.section
            part = (captured or {}).get(("section", s.layer, s.component))
            if part is not None:
                rows = part.take()
            else:
                page, slot = self._section_slots(t, spec)
                view = t.pages.view(t.cache)
                rows = view[page.to(view.device), slot.to(view.device)].cpu()
                self.parts_gathered += 1
            out[:, s.offset: s.offset + s.size_bytes] = rows.reshape(count, s.size_bytes)
        return out

    def window(self, spec: SaveSpec, position: int, captured: Mapping[Part, Capture] | None = None) -> bytes | None:
        """The snapshot at T = `position` from the window pages (`kvstore.codec.snapshot`), or None
        when vLLM already freed a page of [T - window, T) (its null block, id 0)."""
        windows = self.caches.windows
        if windows is None:
            return None
        rows = []
        for layer in range(self.geometry.num_layers):
            part = (captured or {}).get(("window", layer, ""))
            if part is not None:
                rows.append(part.take())
                continue
            slots = self._window_slots(spec, position, layer)
            if slots is None:
                return None
            cache, pages, _ = windows[layer]
            view = pages.view(cache)
            rows.append(view[slots[0].to(view.device), slots[1].to(view.device)].cpu())
            self.parts_gathered += 1
        return join_snapshot(torch.stack(rows), None, geometry=self.geometry)

    def save(self, spec: SaveSpec, captured: Mapping[Part, Capture] | None = None) -> None:
        """Copy the new blocks (and the snapshot, if asked and still in the pages) out now, or take the
        rows `save_layer` copied out (`captured`); put them on the save thread."""
        blocks = self.gather(spec, captured)
        snapshot = None if spec.snapshot_at is None else self.window(spec, spec.snapshot_at, captured)
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
                    # A hinted request's prompt is pinned in this Put's own transaction (R22), no Lookup after.
                    got = self.client.put(spec.tokens, blocks, first_block=spec.first_block,
                                          extra_keys=spec.extra_keys, keep_until_s=spec.keep_until_s)
                    self.blocks_saved += len(blocks)
                    if spec.keep_until_s:
                        with self._lock:
                            self._granted[spec.req_id] = (got.kept_until_s, got.keep_note)
                if snapshot is not None and spec.snapshot_at is not None:
                    self.client.swa.put(spec.tokens[: spec.snapshot_at], snapshot, position=spec.snapshot_at,
                                        extra_keys=spec.extra_keys)
                    self.snapshots_saved += 1
            except Exception as exc:  # a failed save is a future miss, never an engine failure
                self.save_errors += 1
                if spec.keep_until_s:
                    with self._lock:
                        self._granted[spec.req_id] = (0.0, f"the put failed: {exc}")
                log.warning("kvstore: saving blocks %d.. of request %s failed: %s", spec.first_block,
                            spec.req_id, exc)

        with self._lock:
            self._saving.setdefault(spec.req_id, []).append(self._pool.submit(put))

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM ended (now or before), those whose saves are all done; a request's kept
        snapshot is put when it ends."""
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
        return done

    def take_granted(self) -> dict[str, tuple[float, str]]:
        """The pins granted to hinted Puts since the last call (req id -> (time, 0: none; why less))."""
        with self._lock:
            granted, self._granted = self._granted, {}
        return granted

    def _put_snapshot(self, tokens: list[int], position: int, snapshot: bytes, keys: tuple[str, ...]) -> None:
        try:
            self.client.swa.put(tokens, snapshot, position=position, extra_keys=keys)
            self.snapshots_saved += 1
        except Exception as exc:  # a failed save is a future miss
            self.save_errors += 1
            log.warning("kvstore: saving the snapshot at %d failed: %s", position, exc)

    def close(self) -> None:
        """Wait for the puts in flight, then stop the save thread."""
        self._pool.shutdown(wait=True)
