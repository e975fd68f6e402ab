"""The worker side of the vLLM connector: store blocks <-> vLLM's paged caches.

vLLM-free: it is handed the registered cache tensors, the page size of each tensor's KV
cache group, and the scheduler side's `LoadSpec`/`SaveSpec`s. Where each block section and
window row goes: `integrations.vllm_caches`; the layer-by-layer pieces: `integrations.vllm_layers`.
A store block's sections (`geometry.block_layout`) are copied row-run by row-run.

A step's loads run on one loader thread (fetch, then the pages layer by layer); without
`layerwise`, `start_loads` returns once they are all in. Saves are copied out of the pages in the
step that computes them (per layer with `layerwise`) and put on one save thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from integrations.common import PageMap, StoreSettings, fetch_blocks
from integrations.vllm_caches import CacheTarget, map_caches, map_windows
from integrations.vllm_layers import Capture, LayerGate, copy_out, layer_of
from integrations.vllm_scheduler import LoadSpec, SaveSpec
from kvstore.client import Client
from kvstore.codec.snapshot import join_snapshot, split_snapshot
from kvstore.geometry import ModelGeometry

log = logging.getLogger(__name__)


@dataclass
class _Fetched:
    """One load after its fetch: the blocks, how far they cover, the snapshot's window rows and the
    position they start at."""

    spec: LoadSpec
    covered: int
    blocks: torch.Tensor | None = None
    path: str | None = None
    window: tuple[torch.Tensor, int] | None = None


@dataclass
class _StepLoad:
    """A step's loads on the loader thread."""

    fetched: list[_Fetched]
    gate: LayerGate
    layerwise: bool
    future: Future[None] | None = field(default=None, repr=False)


class WorkerSide:
    """Loads and saves of the worker-side connector.

    Args:
        client: the store's client.
        settings: the adapter's settings (load path).
        geometry: the store's geometry; `block_tokens` its block size.
        reader: a `ColocatedReader` for the direct paths, or None.
        layerwise: fill loads layer by layer while the forward runs (it must call `wait_layer` for
            every layer) and copy saves out per layer (`save_layer`); off: all at once.
    """

    def __init__(self, client: Client, settings: StoreSettings, geometry: ModelGeometry, *,
                 reader: Any = None, layerwise: bool = False) -> None:
        self.client, self.settings, self.geometry, self.reader = client, settings, geometry, reader
        self.block_tokens = client.block_tokens
        self.targets: list[CacheTarget] = []
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
        #: Layer-wise loads and saves (turned off when vLLM does not wait per layer, `finish_loads`).
        self.layerwise = layerwise
        #: Called on the loader thread with each layer once it is in the pages (a hook for tests and logs).
        self.layer_filled: Callable[[int], None] | None = None
        #: Parts of saves (a section or a window layer) copied out per layer, and gathered at the step's end.
        self.parts_captured = 0
        self.parts_gathered = 0
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-load")
        self._step: _StepLoad | None = None
        self._streams: dict[str, Any] = {}
        self._captured: dict[tuple[int, str, int, str], Capture] = {}
        self._capture_for: Sequence[SaveSpec] | None = None

    def register(self, caches: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[int, int]]) -> None:
        """`register_kv_caches`: find where each block section goes."""
        self.targets = map_caches(self.geometry, self.block_tokens, caches, groups)
        self.windows = map_windows(self.geometry, caches, groups)

    # -- loads -------------------------------------------------------------------

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """`start_load_kv`: fetch `specs` and fill them layer by layer on the loader thread.

        With `layerwise` this returns at once: the forward waits per layer (`wait_layer`) and the
        step's end collects the outcome (`finish_loads`). Otherwise it returns once every layer is in
        the pages (the all-at-once path, right whether or not vLLM calls the per-layer hooks).
        """
        self.finish_loads()   # a step's loads never outlive it
        if not specs:
            return
        device = self.targets[0].cache.device if self.targets else torch.device("cpu")
        layers = {t.section.layer for t in self.targets}
        if self.windows is not None and any(s.snapshot_at is not None for s in specs):
            layers |= set(self.windows)
        ready = None
        if device.type == "cuda":
            # Pages vLLM just allocated may still be zeroed by queued kernels: the copies come after them.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        job = _StepLoad(fetched=[_Fetched(spec=s, covered=s.start) for s in specs], gate=LayerGate(layers, device),
                        layerwise=self.layerwise)
        job.future = self._loader.submit(self._run_loads, job, ready)
        self._step = job
        if not self.layerwise:
            self.finish_loads()

    def wait_layer(self, name: str) -> None:
        """`wait_for_layer_load`: block until the step's loads filled every layer up to `name`'s (a
        name without `layers.<i>.`: all of them). On CUDA the current stream waits for the copies."""
        job = self._step
        if job is not None:
            job.gate.wait(layer_of(name))

    def _run_loads(self, job: _StepLoad, ready: Any) -> None:
        """Loader thread: every spec's fetch, then the pages layer by layer (each layer released to
        the forward as soon as it is in)."""
        try:
            job.fetched = [self._fetch(f.spec) for f in job.fetched]
            stream = None
            if job.gate.cuda:
                stream = self._stream("load", job.gate.device)
                if ready is not None:
                    stream.wait_event(ready)
                for f in job.fetched:   # made on this thread's stream, read on the load stream until done
                    if f.blocks is not None and f.blocks.is_cuda:
                        f.blocks.record_stream(stream)
            for layer in job.gate.layers:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for f in job.fetched:
                        self._fill(f, layer)
                job.gate.filled(layer, stream)
                if self.layer_filled is not None:
                    self.layer_filled(layer)
        finally:
            job.gate.release()

    def _fetch(self, spec: LoadSpec) -> _Fetched:
        """A spec's blocks (and snapshot window), how far they cover; the plan's lease released."""
        b = self.block_tokens
        f = _Fetched(spec=spec, covered=spec.start)
        try:
            device = self.targets[0].cache.device if self.targets else "cpu"
            blocks, n, f.path = fetch_blocks(self.client, spec.hashes, self.settings, self.reader, device)
            covered = max(min(n * b, spec.end), spec.start)
            if spec.snapshot_at is not None:
                f.window = self._fetch_window(spec)
                if f.window is None:
                    covered = spec.start   # without its window the resume point is no use: vLLM recomputes
            f.blocks, f.covered = blocks[:-(-covered // b)], covered
        except Exception as exc:  # a failed load is recomputed by vLLM, never fatal
            log.warning("kvstore: load of request %s failed from token %d: %s", spec.req_id, spec.start, exc)
        finally:
            if spec.lease_id:
                try:
                    self.client.release(spec.lease_id)
                except Exception as exc:  # the lease lapses on its own
                    log.debug("kvstore: lease release failed: %s", exc)
        return f

    def _fetch_window(self, spec: LoadSpec) -> tuple[torch.Tensor, int] | None:
        """The snapshot at T's window rows `[layers, n, row_bytes]` and the first position n starts at
        (at or above vLLM's own hit); None when it is gone or there are no window caches."""
        at, key = spec.snapshot_at, spec.snapshot_key
        if self.windows is None or at is None or key is None:
            return None
        data = self.client.swa.get_many([key])[0]
        if data is None:
            return None
        rows, _ = split_snapshot(data, at, self.geometry)
        first = max(at - rows.shape[1], spec.start)
        return rows[:, first - (at - rows.shape[1]):], first

    def _fill(self, f: _Fetched, layer: int) -> None:
        """Layer `layer`'s rows of one fetched spec into the pages; a failure fails the whole spec."""
        spec = f.spec
        if f.covered <= spec.start or f.blocks is None:
            return
        try:
            for t in self.targets:
                if t.section.layer == layer:
                    self._scatter(t, f.blocks, spec, spec.start, f.covered)
            if f.window is not None and self.windows is not None and layer in self.windows:
                rows, first = f.window
                cache, pages, group = self.windows[layer]
                at = first + rows.shape[1]
                page, slot = pages.slots(spec.block_ids[group], first, at - first)
                keep = page != 0   # vLLM's null block: a page it did not allocate (out of the window)
                view = pages.view(cache)
                view[page[keep].to(view.device), slot[keep].to(view.device)] = rows[layer].to(view.device)[
                    keep.to(view.device)]
        except Exception as exc:  # recomputed by vLLM, never fatal
            log.warning("kvstore: filling layer %d of request %s failed: %s", layer, spec.req_id, exc)
            f.covered = spec.start

    def _scatter(self, t: CacheTarget, blocks: torch.Tensor, spec: LoadSpec, start: int, end: int) -> None:
        s, r = t.section, t.pages.ratio
        rows = blocks[:, s.offset: s.offset + s.size_bytes].reshape(-1, s.row_bytes)
        first, last = start // r, end // r
        page, slot = t.pages.slots(spec.block_ids[t.group], first, last - first)
        view = t.pages.view(t.cache)
        view[page.to(view.device), slot.to(view.device)] = rows[first:last].to(view.device)

    def finish_loads(self) -> None:
        """The step's loads, done: counters, and what failed recorded for vLLM. Layer-wise, a layer the
        forward did not wait for (a model whose attention calls no per-layer hooks) may have been read
        before it was filled: the step's synchronous loads are then reported failed (vLLM recomputes
        them) and layer-wise loading is turned off."""
        job, self._step = self._step, None
        if job is None:
            return
        try:
            if job.future is not None:
                job.future.result()
        except Exception as exc:  # a bug on the loader thread: every load of the step is recomputed
            log.warning("kvstore: the loader failed: %s", exc)
            job.fetched = [_Fetched(spec=f.spec, covered=f.spec.start) for f in job.fetched]
        job.gate.wait(None)
        missed = sorted(set(job.gate.layers) - job.gate.awaited)
        if job.layerwise and missed and any(not f.spec.asynchronous for f in job.fetched):
            log.warning("kvstore: vLLM did not wait for layer(s) %s of this step's loads (its attention calls "
                        "no wait_for_layer_load): their pages are recomputed; layer-wise loading is off now", missed)
            self.layerwise = False
            for f in job.fetched:
                if not f.spec.asynchronous:
                    f.covered = f.spec.start
        b = self.block_tokens
        for f in job.fetched:
            spec = f.spec
            if f.path is not None:
                self.load_paths[f.path] += 1
            if f.covered > spec.start:
                self.blocks_loaded += -(-f.covered // b) - spec.start // b
                self.snapshots_loaded += f.window is not None
            if f.covered < spec.end:
                log.warning("kvstore: request %s: tokens [%d, %d) not loaded; vLLM recomputes them",
                            spec.req_id, f.covered, spec.end)
                if spec.asynchronous:
                    self._failed_recv.add(spec.req_id)
                else:
                    self._load_errors |= self._pages_of(spec, f.covered, spec.end)
            if spec.asynchronous:
                self._recved.add(spec.req_id)

    def _stream(self, kind: str, device: torch.device) -> Any:
        """This worker's side CUDA stream for `kind` ("load" or "save") on `device`, made once."""
        key = f"{kind}:{device}"
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device)
        return stream

    def _pages_of(self, spec: LoadSpec | SaveSpec, start: int, end: int) -> set[int]:
        ids: set[int] = set()
        for t in self.targets:
            p = t.pages.page_tokens
            ids.update(spec.block_ids[t.group][start // p: -(-end // p)])
        return ids

    def take_load_errors(self) -> set[int]:
        """`get_block_ids_with_load_errors`: vLLM block ids of failed synchronous loads (then cleared)."""
        self.finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -------------------------------------------------------------------

    def _section_slots(self, t: CacheTarget, spec: SaveSpec) -> tuple[torch.Tensor, torch.Tensor]:
        b, r = self.block_tokens, t.pages.ratio
        first, count = spec.first_block, len(spec.tokens) // b - spec.first_block
        lo, hi = first * b // r, (first + count) * b // r
        return t.pages.slots(spec.block_ids[t.group], lo, hi - lo)

    def _window_slots(self, spec: SaveSpec, position: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where layer `layer`'s window rows of [T - window, T) are, T = `position`; None when vLLM
        already freed one of their pages (its null block, id 0)."""
        assert self.windows is not None
        n = min(position, self.geometry.window)
        _, pages, group = self.windows[layer]
        ids = spec.block_ids[group]
        first, last = (position - n) // pages.page_tokens, (position - 1) // pages.page_tokens
        if last >= len(ids) or any(ids[i] == 0 for i in range(first, last + 1)):
            return None
        return pages.slots(ids, position - n, n)

    def save_layer(self, specs: Sequence[SaveSpec], name: str) -> None:
        """`save_kv_layer`: copy the rows of `name`'s layer that `specs` save out of the pages now, right
        after the layer wrote them (on CUDA: a gather on the current stream, then an asynchronous copy
        to pinned host memory); `save_step` takes them instead of gathering them again."""
        layer = layer_of(name)
        if layer is None or not specs:
            return
        if self._capture_for is not specs:   # a new step's saves
            self._captured, self._capture_for = {}, specs
        for i, spec in enumerate(specs):
            if len(spec.tokens) // self.block_tokens > spec.first_block:
                for t in self.targets:
                    key = (i, "section", layer, t.section.component)
                    if t.section.layer == layer and key not in self._captured:
                        page, slot = self._section_slots(t, spec)
                        self._captured[key] = self._copy_out(t.cache, t.pages, page, slot)
            key = (i, "window", layer, "")
            if (spec.snapshot_at is not None and self.windows is not None and layer in self.windows
                    and key not in self._captured):
                slots = self._window_slots(spec, spec.snapshot_at, layer)
                if slots is not None:
                    cache, pages, _ = self.windows[layer]
                    self._captured[key] = self._copy_out(cache, pages, *slots)

    def _copy_out(self, cache: torch.Tensor, pages: PageMap, page: torch.Tensor, slot: torch.Tensor) -> Capture:
        view = pages.view(cache)
        stream = self._stream("save", view.device) if view.device.type == "cuda" else None
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

    def gather(self, spec: SaveSpec, captured: Mapping[tuple[str, int, str], Capture] | None = None
               ) -> torch.Tensor:
        """The store blocks [first_block, len(tokens) // block_tokens) of a request, from its pages (or
        from the rows `save_layer` copied out: `captured`)."""
        b = self.block_tokens
        count = len(spec.tokens) // b - spec.first_block
        out = torch.empty((count, self.client.block_bytes), dtype=torch.uint8)
        for t in self.targets if count > 0 else ():
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

    def window(self, spec: SaveSpec, position: int,
               captured: Mapping[tuple[str, int, str], Capture] | None = None) -> bytes | None:
        """The snapshot at T = `position` from the window pages (`kvstore.codec.snapshot`), or None
        when vLLM already freed a page of [T - window, T) (its null block, id 0)."""
        if self.windows is None:
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
            cache, pages, _ = self.windows[layer]
            view = pages.view(cache)
            rows.append(view[slots[0].to(view.device), slots[1].to(view.device)].cpu())
            self.parts_gathered += 1
        return join_snapshot(torch.stack(rows), None, geometry=self.geometry)

    def save(self, spec: SaveSpec, captured: Mapping[tuple[str, int, str], Capture] | None = None) -> None:
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
        self.finish_loads()
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
        self.finish_loads()
        failed, self._failed_recv = self._failed_recv, set()
        return failed

    def close(self) -> None:
        """Wait for the loads and puts in flight, then close the client."""
        self.finish_loads()
        self._loader.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.client.close()
