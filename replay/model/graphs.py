"""The bounded replay step over fixed buffers, captured in CUDA graphs (issue 25 item 3).

A 128-token bounded replay over 40 layers is bound by the host launching ~1,400 small
kernels (replay.model.fast: 13.9 ms of GPU work in ~34 ms of wall time on the H200).
This module runs the same step, op for op, as a few CUDA graphs over buffers whose
shapes do not depend on H, so a worker's replays at any H reuse the graphs:

- **What is captured.** The step of `fast.step` is cut at each index layer into
  segments: segment 0 is the embedding, the RoPE tables and the layers up to the first
  index layer's projections; segment j ends at the next index layer's projections; the
  last one ends with the logits, the window rows, the tail and the rows' finite check.
  Each segment is one CUDA graph. Its inputs are fixed buffers: the tokens, the
  positions, the window rows held before the step, and per index layer the selected
  compressed rows (already gathered, `[m, used, head_dim]`) and their mask.
- **What is not.** Between two segments the index layer's scoring and top-k run eagerly
  (`fast.index_select`, about 30 kernels), because their shapes are H's: the keys are
  the state's visible indexer rows. Run at its exact shape it launches the kernels
  today's step launches, so the selection is bit for bit today's; scoring a padded
  capacity instead would change the matmul's and top-k's shapes, which cuBLAS does not
  promise to sum alike. The selected rows are gathered once per index layer into the
  fixed buffer (today's step gathers the same rows once per layer reading them).
- **Buckets.** Everything a graph's shapes depend on is a host int: tokens m, window
  rows held, layers run, the end's parity (the raw tail) and the slots each index layer
  keeps (min(top-k, horizon): constant once H >= 2 x top-k). A bucket (its buffers and
  graphs) is built per key, least recently used first out past `MAX_BUCKETS`; a change
  of any weight drops them all (the packed weights are read by address).
- **When it runs.** Only a step that computes no compressed row (every group of the
  step is held: a bounded replay over loaded rows) and has at most `MAX_TOKENS`
  tokens; any other step is `fast.step`'s. Logits and rows are equal to `fast.step`'s
  (torch.equal: tests/replay/model/test_graphs.py on the CPU, where the same buffers run
  eagerly, and tests/replay/model/test_graphs_gpu.py on CUDA against the graphs).

Without CUDA (`capture=False`) the buckets run their segments eagerly: the same code on
the same buffers, which is what the CPU tests check against `fast.step`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvstore.errors import InvalidArgument
from replay.model import fast
from replay.model.fast import Chosen, LayerIn, _pack, _Step
from replay.model.layers import groups_to_compute
from replay.model.state import CacheState
from replay.model.weights import ModelWeights

#: Longest step captured: a bounded replay of 4 windows of V4.1 (512 tokens, the default fidelity budget's
#: span) fits; its gathered rows take m x top-k x head_dim floats per index layer (512 MB each at 512).
MAX_TOKENS = 512
#: Buckets (buffers and graphs) kept per model.
MAX_BUCKETS = 4


@dataclass(frozen=True)
class BucketKey:
    """Everything the shapes of a captured step depend on."""

    tokens: int
    top: int
    before: int  # window rows every layer holds at the step's start
    odd_end: bool
    used: tuple[int, ...]  # slots kept by each index layer <= top, in layer order


def bucket_key(model: ModelWeights, state: CacheState, m: int, top: int) -> BucketKey | None:
    """The bucket of a step of m tokens at state.length, or None when the step is not one this path takes."""
    cfg, g = model.config, model.config.geometry
    if not 0 < m <= MAX_TOKENS:
        return None
    start, end = state.length, state.length + m
    before = state.window_rows[0].shape[0]
    if any(state.window_rows[layer].shape[0] != before for layer in range(1, top + 1)):
        return None
    for source in g.kv_source_layers:
        if source <= top and groups_to_compute(g, state, source, start, end) != 0:
            return None  # it appends rows (or raises): the eager step does that
    used = []
    for layer in cfg.index_layers:
        if layer <= top:
            src = g.source_of(layer)
            assert src is not None
            horizon = min(end // g.compress_ratios[src], state.kv_rows[src].shape[0])
            used.append(fast.used_slots(cfg, horizon))
    return BucketKey(tokens=m, top=top, before=before, odd_end=bool(end % 2), used=tuple(used))


@dataclass
class _Carry:
    """Tensors one segment leaves to the next (graph memory when captured: kept alive here)."""

    s: _Step | None = None
    h: Tensor | None = None
    pending: dict[int, LayerIn] = field(default_factory=dict)  # index layer -> its projections
    queries: dict[int, Tensor] = field(default_factory=dict)  # index layer -> rotated indexer query
    rows: dict[int, Tensor] = field(default_factory=dict)  # layer -> its window rows after the step
    tails: dict[int, Tensor] = field(default_factory=dict)
    finite: Tensor | None = None
    window: Tensor | None = None  # [top + 1, rows, row bytes]
    tail: Tensor | None = None
    logits: Tensor | None = None


class _Bucket:
    """One key's fixed buffers and segments (and, once captured, one CUDA graph per segment)."""

    def __init__(self, model: ModelWeights, key: BucketKey, capture: bool) -> None:
        cfg, g = model.config, model.config.geometry
        dev = model.device
        self.model, self.key, self.capture = model, key, capture
        m = key.tokens
        self.index_layers = [layer for layer in cfg.index_layers if layer <= key.top]
        self.toks = torch.zeros(m, dtype=torch.long, device=dev)
        self.pos = torch.zeros(m, dtype=torch.long, device=dev)
        self.prev = torch.zeros((key.top + 1, key.before, g.window_row_bytes), dtype=torch.uint8, device=dev)
        self.gathered = {layer: torch.zeros((m, used, g.head_dim), device=dev)
                         for layer, used in zip(self.index_layers, key.used, strict=True)}
        self.mask = {layer: torch.zeros((m, 1, used), device=dev)
                     for layer, used in zip(self.index_layers, key.used, strict=True)}
        self.carry = _Carry()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.weights = _weights(model)

    # -- the step, in segments ------------------------------------------------------------

    def segment(self, j: int, state: CacheState) -> None:
        """Segment j (see the module docstring): reads the fixed buffers and the carry only."""
        model, c, key = self.model, self.carry, self.key
        g = model.config.geometry
        if j == 0:
            # A stand-in state holding only the length: the carry outlives the call and must not keep its rows.
            c.s = _Step(model, CacheState(length=state.length, window_rows=[], kv_rows={}, index_rows={}),
                        key.tokens, pos=self.pos)
            c.h = model.embed[self.toks]
            c.pending, c.queries, c.rows, c.tails = {}, {}, {}, {}
            lo = 0
        else:
            lo = self.index_layers[j - 1]
            self._attend(lo, c.pending[lo])
            lo += 1
        last = j == len(self.index_layers)
        hi = key.top + 1 if last else self.index_layers[j]
        for layer in range(lo, hi):
            self._attend(layer, self._project(layer))
        if not last:
            # Kept in the carry, not dropped after the next segment's attention: a captured segment runs its
            # Python once, and select() reads the index layer's projections at every replay.
            c.pending[hi] = self._project(hi)
            return
        s = c.s
        assert s is not None and c.h is not None
        c.finite = s.finite()
        c.window = torch.stack([c.rows[layer] for layer in range(key.top + 1)])
        c.tail = fast.end_tail(g, int(key.odd_end), c.tails, model.device)  # only the end's parity matters
        c.logits = fast.head(model, c.h) if key.top == g.num_layers - 1 else None

    def _project(self, layer: int) -> LayerIn:
        """A layer up to its index: projections, window rows, the raw tail, the indexer query."""
        c = self.carry
        s, g = c.s, self.model.config.geometry
        assert s is not None and c.h is not None
        inp = fast.layer_in(s, _pack(self.model.blocks[layer]), layer, c.h, self.prev[layer])  # type: ignore[arg-type]
        if inp.kv is not None and inp.score is not None:
            tail = fast.open_pair(g, layer, int(self.key.odd_end), inp.kv, inp.score)  # the end's parity
            if tail is not None:
                c.tails[layer] = tail
        if inp.qi is not None:
            c.queries[layer] = fast.index_query(s, inp.qi)
        return inp

    def _attend(self, layer: int, inp: LayerIn) -> None:
        """A layer from its attention on (its selection read from the fixed buffers)."""
        c, model = self.carry, self.model
        cfg, g = model.config, model.config.geometry
        s = c.s
        assert s is not None and c.h is not None
        pack = _pack(model.blocks[layer])  # type: ignore[arg-type]
        chosen = None
        index_layer = cfg.index_layer_of(layer)
        if index_layer is not None:
            chosen = Chosen(mask=self.mask[index_layer], gathered=self.gathered[index_layer])
        attn = fast._attention(s, pack, layer, inp.q, inp.window_keys, inp.before, chosen)
        c.rows[layer] = inp.both[-g.window:]
        c.h = fast.layer_out(s, pack, c.h, attn)

    def select(self, i: int, state: CacheState) -> None:
        """Index layer i's scoring and top-k, eagerly at H's shapes; the rows it picks into the buffers."""
        layer = self.index_layers[i]
        model = self.model
        g = model.config.geometry
        source = g.source_of(layer)
        assert source is not None
        s, c = self.carry.s, self.carry
        assert s is not None and c.pending[layer].weights is not None
        idx, mask = fast.index_select(model.config, state, source, state.length + self.key.tokens, self.pos,
                                      c.queries[layer], c.pending[layer].weights)  # type: ignore[arg-type]
        values = fast.source_values(state, source, g.head_dim)
        torch.index_select(values, 0, idx.reshape(-1), out=self.gathered[layer].view(-1, g.head_dim))
        self.mask[layer].copy_(mask)

    # -- running ------------------------------------------------------------------------

    def run(self, state: CacheState, toks: Tensor) -> None:
        """The step on `state`'s inputs: eagerly, or by replaying the graphs (captured on first use)."""
        self.toks.copy_(toks)
        torch.arange(state.length, state.length + self.key.tokens, out=self.pos)
        if self.key.before:
            for layer in range(self.key.top + 1):
                self.prev[layer].copy_(state.window_rows[layer])
        if not self.capture:
            self._eager(state)
            return
        if not self.graphs:
            self._capture(state)
        for j, graph in enumerate(self.graphs):
            graph.replay()
            if j < len(self.index_layers):
                self.select(j, state)

    def _eager(self, state: CacheState) -> None:
        for j in range(len(self.index_layers) + 1):
            self.segment(j, state)
            if j < len(self.index_layers):
                self.select(j, state)

    def _capture(self, state: CacheState) -> None:
        """Warm up on a side stream (kernels built, library handles made), then capture each segment."""
        g = self.model.config.geometry
        for source in g.kv_source_layers:  # the state's float copies on this stream, not the side one
            if source <= self.key.top:
                state.kv_values(source)
                state.index_values(source)
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            self._eager(state)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        self.carry = _Carry()
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for j in range(len(self.index_layers) + 1):
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (a worker's store client) do not break the capture
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                self.segment(j, state)
            graphs.append(graph)
        self.graphs = graphs


def _weights(model: ModelWeights) -> tuple[object, ...]:
    """What the captured kernels read by address: each layer's pack (rebuilt when a weight changes) and
    the (version, address) of the embedding, final norm and head."""
    packs = tuple(_pack(block) for block in model.blocks)  # type: ignore[arg-type]
    return packs + tuple((p._version, p.data_ptr()) for p in (model.embed, model.final_norm, model.head))


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    # packs by identity (a dataclass of tensors has no ==), (version, address) pairs by value
    return len(a) == len(b) and all(x is y or (isinstance(x, tuple) and x == y) for x, y in zip(a, b, strict=True))


class StepGraphs:
    """A model's captured steps: `step` takes a step when it fits a bucket (see the module docstring).

    Args:
        model: the model (batch_invariant=False: the fused step's arithmetic).
        capture: capture CUDA graphs (default: on a CUDA model); False runs the same buffers eagerly.
    """

    def __init__(self, model: ModelWeights, capture: bool | None = None) -> None:
        self.model = model
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.buckets: OrderedDict[BucketKey, _Bucket] = OrderedDict()
        #: Steps taken by a bucket, and buckets built (captures), since the start: for tests and the bench.
        self.steps = 0
        self.built = 0
        #: A key is captured the `capture_after`-th time a step fits it; before, its steps are the eager fused
        #: step's (the caller runs it): a capture (a warm-up and one capture per segment) pays only when reused,
        #: and a run of one-off shapes (a fidelity sweep over small H) never captures.
        self.capture_after = 2 if self.capture else 1
        self.seen: OrderedDict[BucketKey, int] = OrderedDict()

    def step(self, state: CacheState, toks: Tensor, *, top: int) -> tuple[bool, Tensor | None]:
        """(taken, logits): the step as `fast.step` computes it, or (False, None) when it fits no bucket.

        Raises:
            InvalidArgument: the step's rows hold NaN or Inf (the state is then left as it was).
        """
        key = bucket_key(self.model, state, toks.numel(), top)
        if key is None:
            return False, None
        bucket = self.buckets.get(key)
        if bucket is not None and not _same(bucket.weights, _weights(self.model)):
            self.buckets.clear()  # a weight changed: the packs the graphs read are gone
            bucket = None
        if bucket is None:
            times = self.seen.pop(key, 0) + 1
            if times < self.capture_after:
                self.seen[key] = times
                while len(self.seen) > 64:
                    self.seen.popitem(last=False)
                return False, None
            bucket = _Bucket(self.model, key, self.capture)
            self.buckets[key] = bucket
            self.built += 1
            while len(self.buckets) > MAX_BUCKETS:
                self.buckets.popitem(last=False)
        self.buckets.move_to_end(key)
        bucket.run(state, toks)
        c = bucket.carry
        assert c.finite is not None and c.window is not None
        if not bool(c.finite):  # the step's one host sync
            raise InvalidArgument("the model produced NaN or Inf; the cache cannot store it")
        window = c.window.clone()  # the buffers are the next step's: the state gets copies
        for layer in range(top + 1):
            state.window_rows[layer] = window[layer]
        state.length += key.tokens
        state.tail = None if c.tail is None else c.tail.clone()
        self.steps += 1
        return True, None if c.logits is None else c.logits.clone()


__all__ = ["MAX_BUCKETS", "MAX_TOKENS", "BucketKey", "StepGraphs", "bucket_key"]
