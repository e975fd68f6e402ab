"""Layer by layer: what the vLLM worker side needs to pipeline loads and saves with the forward.

vLLM-free. Used by `integrations.vllm_loads` and `integrations.vllm_saves`:

- `LayerGate`: a step's loads are filled in layer order on a loader thread; `wait(k)` returns once
  every layer up to k is in the pages (on CUDA, after also making the caller's stream wait for the
  copies of those layers). Cumulative on purpose: a layer that reads another layer's compressed
  KV (V4.1's layers 3-7 read layer 2's) only ever reads a lower layer.
- `Capture` / `copy_out`: the rows a save needs, copied out of the pages right after the layer that
  wrote them (on CUDA: an indexed gather on the caller's stream, then an asynchronous copy into
  pinned host memory on a side stream, with an event to wait on).
- `SideStream`: the loads' (or the saves') own CUDA stream on each device.

A cache name maps to its layer by `layers.<i>.` in it (`layer_of`), as vLLM names them.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from integrations.common import RowsView

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer index in a vLLM layer or cache name (`...layers.<i>....`), or None."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


class LayerGate:
    """One step's fill progress, layer by layer.

    Args:
        layers: the layers the step fills, in fill order (ascending).
        device: the caches' device; on CUDA each filled layer carries an event recorded on the
            loader's stream after its copies.
    """

    def __init__(self, layers: Iterable[int], device: torch.device) -> None:
        self.layers = sorted(set(layers))
        self.device = device
        self.cuda = device.type == "cuda"
        self._filled = {layer: threading.Event() for layer in self.layers}
        self._events: dict[int, Any] = {}
        #: Layers the forward waited for (`wait`); the worker checks them when the step ends.
        self.awaited: set[int] = set()

    def filled(self, layer: int, stream: Any = None) -> None:
        """Loader thread: `layer`'s rows are in the pages (queued on `stream`, on CUDA)."""
        if self.cuda and stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._events[layer] = event
        self._filled[layer].set()

    def release(self) -> None:
        """Loader thread, at its end whatever happened: nobody waits forever for a layer."""
        for event in self._filled.values():
            event.set()

    def wait(self, layer: int | None) -> None:
        """Block until every layer up to `layer` is filled (all of them for None); on CUDA the
        current stream then waits for those layers' copies (the CPU does not)."""
        upto = [k for k in self.layers if layer is None or k <= layer]
        if layer is not None:
            self.awaited.add(layer)
        for k in upto:
            self._filled[k].wait()
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for k in upto:
                event = self._events.get(k)
                if event is not None:
                    stream.wait_event(event)


class SideStream:
    """One CUDA stream of its own per device, made on first use: the loader's copies into the pages,
    or the saves' copies to host memory, kept off vLLM's current stream."""

    def __init__(self) -> None:
        self._streams: dict[str, Any] = {}

    def on(self, device: torch.device) -> Any:
        """The stream on `device` (a CUDA device)."""
        stream = self._streams.get(str(device))
        if stream is None:
            stream = self._streams[str(device)] = torch.cuda.Stream(device=device)
        return stream


@dataclass
class Capture:
    """Rows copied out of the pages: host memory once `take` returns.

    Attributes:
        rows: uint8 `[n, row_bytes]` host tensor (pinned staging on CUDA, written asynchronously).
        event: the CUDA event after the device-to-host copy, or None (a CPU copy, done).
        keep: the device tensor the copy reads, kept alive until then.
    """

    rows: torch.Tensor
    event: Any = None
    keep: Any = None

    def take(self) -> torch.Tensor:
        """The rows, once the copy is done (valid as long as this capture is referenced)."""
        if self.event is not None:
            self.event.synchronize()
            self.event, self.keep = None, None
        return self.rows


def copy_out(view: RowsView, page: torch.Tensor, slot: torch.Tensor, stream: Any = None) -> Capture:
    """The rows `view[page, slot]` of a `[pages, rows, row_bytes]` cache view, copied out now.

    On CUDA the gather runs on the current stream (after the layer's writes, in stream order) and
    the copy to pinned host memory on `stream`, which first waits for the current one.
    """
    if view.device.type != "cuda":
        return Capture(rows=view[page, slot])
    # Indices through pinned memory: a pageable copy would block this thread until the stream drains,
    # stalling the forward's kernel launches.
    rows = view[page.pin_memory().to(view.device, non_blocking=True),
                slot.pin_memory().to(view.device, non_blocking=True)]
    current = torch.cuda.current_stream(view.device)
    side = stream if stream is not None else current
    side.wait_stream(current)
    staging = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(side):
        staging.copy_(rows, non_blocking=True)
        rows.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
    return Capture(rows=staging, event=event, keep=rows)
