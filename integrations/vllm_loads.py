"""The vLLM worker side's loads: store blocks (and snapshot windows) into vLLM's paged caches.

vLLM-free. A step's loads run on one loader thread: every spec's fetch (`integrations.common.
fetch_blocks`: direct, shm or gRPC), then the pages layer by layer in ascending order, each layer
released to the forward as soon as it is in (`integrations.vllm_layers.LayerGate`). Without
`layerwise`, `start` returns once they are all in. What failed is reported to vLLM, which
recomputes it: the vLLM pages of a synchronous load, or the request of an asynchronous one.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from integrations.common import StoreSettings, fetch_blocks
from integrations.vllm_caches import CacheMap, CacheTarget
from integrations.vllm_layers import LayerGate, SideStream, layer_of
from integrations.vllm_scheduler import LoadSpec
from kvstore.client import Client
from kvstore.codec.snapshot import split_snapshot
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


class Loader:
    """The loads of the worker-side connector, one step at a time.

    Args:
        client: the store's client.
        settings: the adapter's settings (load path).
        geometry: the store's geometry.
        reader: a `ColocatedReader` for the direct paths, or None.
        layerwise: fill loads layer by layer while the forward runs (it must call `wait_layer` for
            every layer); off: all at once.
    """

    def __init__(self, client: Client, settings: StoreSettings, geometry: ModelGeometry, *,
                 reader: Any = None, layerwise: bool = False) -> None:
        self.client, self.settings, self.geometry, self.reader = client, settings, geometry, reader
        self.block_tokens = client.block_tokens
        #: Where the rows go (set when vLLM registers its caches).
        self.caches = CacheMap()
        #: Counters: blocks loaded, snapshots loaded, loads by path.
        self.blocks_loaded = 0
        self.snapshots_loaded = 0
        self.load_paths: Counter[str] = Counter()
        #: Layer-wise loads (turned off when vLLM does not wait per layer, `finish`).
        self.layerwise = layerwise
        #: Called on the loader thread with each layer once it is in the pages (a hook for tests and logs).
        self.layer_filled: Callable[[int], None] | None = None
        self._errors: set[int] = set()
        self._recved: set[str] = set()
        self._failed_recv: set[str] = set()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-load")
        self._step: _StepLoad | None = None
        self._stream = SideStream()

    def start(self, specs: Sequence[LoadSpec]) -> None:
        """`start_load_kv`: fetch `specs` and fill them layer by layer on the loader thread.

        With `layerwise` this returns at once: the forward waits per layer (`wait_layer`) and the
        step's end collects the outcome (`finish`). Otherwise it returns once every layer is in
        the pages (the all-at-once path, right whether or not vLLM calls the per-layer hooks).
        """
        self.finish()   # a step's loads never outlive it
        if not specs:
            return
        device = self.caches.device
        layers = {t.section.layer for t in self.caches.targets}
        if self.caches.windows is not None and any(s.snapshot_at is not None for s in specs):
            layers |= set(self.caches.windows)
        ready = None
        if device.type == "cuda":
            # Pages vLLM just allocated may still be zeroed by queued kernels: the copies come after them.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        job = _StepLoad(fetched=[_Fetched(spec=s, covered=s.start) for s in specs], gate=LayerGate(layers, device),
                        layerwise=self.layerwise)
        job.future = self._loader.submit(self._run, job, ready)
        self._step = job
        if not self.layerwise:
            self.finish()

    def wait_layer(self, name: str) -> None:
        """`wait_for_layer_load`: block until the step's loads filled every layer up to `name`'s (a
        name without `layers.<i>.`: all of them). On CUDA the current stream waits for the copies."""
        job = self._step
        if job is not None:
            job.gate.wait(layer_of(name))

    def _run(self, job: _StepLoad, ready: Any) -> None:
        """Loader thread: every spec's fetch, then the pages layer by layer (each layer released to
        the forward as soon as it is in)."""
        try:
            job.fetched = [self._fetch(f.spec) for f in job.fetched]
            stream = None
            if job.gate.cuda:
                stream = self._stream.on(job.gate.device)
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
            blocks, n, f.path = fetch_blocks(self.client, spec.hashes, self.settings, self.reader, self.caches.device)
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
        if self.caches.windows is None or at is None or key is None:
            return None
        data = self.client.swa.get_many([key])[0]
        if data is None:
            return None
        rows, _ = split_snapshot(data, at, self.geometry)
        first = max(at - rows.shape[1], spec.start)
        return rows[:, first - (at - rows.shape[1]):], first

    def _fill(self, f: _Fetched, layer: int) -> None:
        """Layer `layer`'s rows of one fetched spec into the pages; a failure fails the whole spec."""
        spec, windows = f.spec, self.caches.windows
        if f.covered <= spec.start or f.blocks is None:
            return
        try:
            for t in self.caches.targets:
                if t.section.layer == layer:
                    self._scatter(t, f.blocks, spec, spec.start, f.covered)
            if f.window is not None and windows is not None and layer in windows:
                rows, first = f.window
                cache, pages, group = windows[layer]
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

    def finish(self) -> None:
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
                    self._errors |= self._pages_of(spec, f.covered, spec.end)
            if spec.asynchronous:
                self._recved.add(spec.req_id)

    def _pages_of(self, spec: LoadSpec, start: int, end: int) -> set[int]:
        ids: set[int] = set()
        for t in self.caches.targets:
            p = t.pages.page_tokens
            ids.update(spec.block_ids[t.group][start // p: -(-end // p)])
        return ids

    def take_errors(self) -> set[int]:
        """`get_block_ids_with_load_errors`: vLLM block ids of failed synchronous loads (then cleared)."""
        self.finish()
        errors, self._errors = self._errors, set()
        return errors

    def take_recved(self) -> set[str]:
        """Requests whose asynchronous load is done (loaded or failed), then cleared."""
        self.finish()
        recved, self._recved = self._recved, set()
        return recved

    def take_failed_recving(self) -> set[str]:
        """Requests whose asynchronous load failed (vLLM recomputes them), then cleared."""
        self.finish()
        failed, self._failed_recv = self._failed_recv, set()
        return failed

    def close(self) -> None:
        """Wait for the step's loads, then stop the loader thread."""
        self.finish()
        self._loader.shutdown(wait=True)
