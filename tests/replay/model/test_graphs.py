"""The fixed-buffer replay step (replay.model.graphs) against the fused step, on the CPU.

On the CPU the buckets run their segments eagerly: the same code over the same fixed buffers
that CUDA captures in graphs (tests/replay/model/test_graphs_gpu.py replays those). Everything it
computes must be bit for bit the fused step's (`model.graphs = False`): the replay's logits, the
window rows, the tail, and what a continuation computes from the state.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvstore.errors import InvalidArgument  # noqa: E402
from replay.model import TINY_MODEL, CacheState, ReferenceModel  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks  # noqa: E402
from replay.model.graphs import MAX_TOKENS, bucket_key  # noqa: E402
from replay.model.layers import groups_to_compute, new_compressor_inputs  # noqa: E402

G = TINY_MODEL.geometry
BLOCK = 4  # W / 2, V4.1's 64 against 128
TOKENS = 400
#: aten ops that read a device value back to the host (each a sync on CUDA; test_fast.py counts the same).
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select")


class _HostReads(TorchDispatchMode):
    """Counts the aten ops under it that read a device value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += str(func.overloadpacket) in HOST_READS
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(TINY_MODEL, batch_invariant=False)


@pytest.fixture(scope="module")
def conversations(model: ReferenceModel) -> list[tuple[list[int], Any]]:
    """Two conversations (tokens, blocks of their first 384 tokens): different tokens, different rows."""
    out = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, TINY_MODEL.vocab_size, (TOKENS,), generator=gen).tolist()
        state = model.new_state()
        model.extend(state, tokens[:384])
        out.append((tokens, state_blocks(G, state, BLOCK)))
    torch.set_num_threads(before)
    return out


def _rows(blocks: Any, h: int) -> CacheState:
    return restore_state(G, blocks[:h // BLOCK], None, position=h, resume=h, device="cpu")


def _replay(model: ReferenceModel, graphs: bool, tokens: list[int], rows: CacheState,
            span: int) -> tuple[CacheState, Any]:
    model.graphs = graphs
    try:
        return model.replay_logits(tokens, rows, span=span)
    finally:
        model.graphs = False


def _assert_same(a: tuple[CacheState, Any], b: tuple[CacheState, Any]) -> None:
    (sa, la), (sb, lb) = a, b
    assert torch.equal(la, lb)
    assert sa.length == sb.length
    assert all(torch.equal(x, y) for x, y in zip(sa.window_rows, sb.window_rows, strict=True))
    assert (sa.tail is None) == (sb.tail is None)
    assert sa.tail is None or sb.tail is None or torch.equal(sa.tail, sb.tail)
    for s in G.kv_source_layers:
        assert torch.equal(sa.kv_rows[s], sb.kv_rows[s]) and torch.equal(sa.index_rows[s], sb.index_rows[s])


@pytest.mark.parametrize("h,span", [(384, 8), (384, 16), (200, 3), (100, 8), (40, 8), (24, 16)])
def test_replay_through_the_buffers_equals_the_fused_step(model: ReferenceModel, conversations: Any, h: int,
                                                          span: int) -> None:
    """Logits, window rows, tail and rows bit for bit the fused step's, at H where the index keeps every
    top-k slot (384) and where it keeps fewer (40, 24: horizon < top-k), spans shorter and longer than W;
    and a continuation from either state computes the same logits."""
    tokens, blocks = conversations[0]
    steps = model.step_graphs().steps
    fused = _replay(model, False, tokens, _rows(blocks, h), span)
    static = _replay(model, True, tokens, _rows(blocks, h), span)
    assert model.step_graphs().steps == steps + 1  # the bucket took the step
    _assert_same(fused, static)
    assert torch.equal(model.extend(fused[0], tokens[h:h + 9]), model.extend(static[0], tokens[h:h + 9]))


def test_odd_h_gives_the_same_tail(model: ReferenceModel, conversations: Any) -> None:
    """At an odd H the ratio-2 source's open pair is the tail: the buffers' copy equals the fused one."""
    tokens, _ = conversations[0]
    state = model.new_state()
    model.extend(state, tokens[:201])
    for span in (8, 5):
        fused = _replay(model, False, tokens, state.clone(), span)
        static = _replay(model, True, tokens, state.clone(), span)
        assert static[0].tail is not None and static[0].tail.shape == (1, 2, G.head_dim)
        _assert_same(fused, static)


def test_one_bucket_serves_other_inputs(model: ReferenceModel, conversations: Any) -> None:
    """Two conversations at three H, through the one bucket of (8 tokens, horizon >= top-k): each replay is
    the fused step's, so no buffer (tokens, positions, gathered rows, mask) keeps the previous input."""
    model.step_graphs().buckets.clear()
    built = model.step_graphs().built
    runs = [(c, h) for h in (384, 256, 320) for c in (0, 1)] + [(0, 384)]
    for c, h in runs:
        tokens, blocks = conversations[c]
        fused = _replay(model, False, tokens, _rows(blocks, h), 8)
        _assert_same(fused, _replay(model, True, tokens, _rows(blocks, h), 8))
    assert model.step_graphs().built == built + 1 and len(model.step_graphs().buckets) == 1


def test_steps_that_write_rows_take_the_fused_step(model: ReferenceModel, conversations: Any) -> None:
    """A prefill and decode steps compute compressed rows: no bucket takes them, and they are the fused step's."""
    tokens, blocks = conversations[0]
    steps = model.step_graphs().steps
    model.graphs = True
    try:
        a = model.new_state()
        la = model.extend(a, tokens[:40])
        la = torch.cat((la, model.extend(a, tokens[40:42])))
    finally:
        model.graphs = False
    b = model.new_state()
    lb = model.extend(b, tokens[:40])
    lb = torch.cat((lb, model.extend(b, tokens[40:42])))
    assert torch.equal(la, lb)
    assert model.step_graphs().steps == steps
    assert bucket_key(model, _rows(blocks, 384), MAX_TOKENS + 1, G.num_layers - 1) is None


def test_one_host_read_per_step(model: ReferenceModel, conversations: Any) -> None:
    """The segments a graph captures read nothing back to the host (capture would fail): a step through the
    buffers makes one host read, the finite check after the last segment."""
    tokens, blocks = conversations[0]
    _replay(model, True, tokens, _rows(blocks, 384), 8)  # the bucket exists: this step only runs it
    rows = _rows(blocks, 384)
    for s in G.kv_source_layers:  # the rows' float copies, decoded before counting (as the fused test does)
        rows.kv_values(s)
        rows.index_values(s)
    with _HostReads() as reads:
        _replay(model, True, tokens, rows, 8)
    assert reads.count == 1


def test_nan_is_refused_and_the_state_kept(conversations: Any) -> None:
    """NaN in the rows a bucket writes raises InvalidArgument before the state changes."""
    model = ReferenceModel(TINY_MODEL, batch_invariant=False)
    tokens, blocks = conversations[0]
    with torch.no_grad():
        model.blocks[2].wkv.fill_(float("nan"))  # type: ignore[operator]
    rows = _rows(blocks, 384)
    state = CacheState(length=376, window_rows=model.new_state().window_rows, kv_rows=dict(rows.kv_rows),
                       index_rows=dict(rows.index_rows))
    model.graphs = True
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        model.extend(state, tokens[376:384], tail_prefill=False)
    assert model.step_graphs().built == 1
    assert state.length == 376 and all(w.shape[0] == 0 for w in state.window_rows)


def test_a_weight_change_rebuilds_the_buckets(conversations: Any) -> None:
    """The buffers' kernels read the packed weights: after a weight changes the next step is the fused
    step's with the new weights, through a new bucket."""
    model = ReferenceModel(TINY_MODEL, batch_invariant=False)
    tokens, blocks = conversations[0]
    _replay(model, True, tokens, _rows(blocks, 384), 8)
    with torch.no_grad():
        model.blocks[3].wq.mul_(1.5)  # type: ignore[operator]
        model.head.mul_(0.5)
    fused = _replay(model, False, tokens, _rows(blocks, 384), 8)
    _assert_same(fused, _replay(model, True, tokens, _rows(blocks, 384), 8))
    assert model.step_graphs().built == 2


def test_groups_to_compute_is_what_the_compressor_computes() -> None:
    """The host-int count a bucket decides by equals the rows new_compressor_inputs gives (None where it raises)."""
    hd = G.head_dim
    for layer in G.kv_source_layers:
        ratio = G.compress_ratios[layer]
        for start in range(0, 14):
            for m in range(1, 7):
                for have in range(0, 12):
                    for tail in (False, True):
                        state = CacheState(length=start, window_rows=[],
                                           kv_rows={layer: torch.zeros((have, 1), dtype=torch.uint8)},
                                           index_rows={}, tail=torch.zeros((1, 2, hd)) if tail else None)
                        kv = torch.zeros((m, hd))
                        try:
                            want: int | None = new_compressor_inputs(G, state, layer, kv, kv, start,
                                                                     start + m).kv.shape[0]
                        except InvalidArgument:
                            want = None
                        got = groups_to_compute(G, state, layer, start, start + m)
                        assert got == want or (want is None and got), (layer, ratio, start, m, have, tail)


def test_a_step_after_a_held_window(model: ReferenceModel, conversations: Any) -> None:
    """A step from a state that holds window rows (and the rows of its groups): the held rows go through the
    bucket's window buffer, for two conversations in turn through the one bucket."""
    for c in (0, 1, 0):
        tokens, blocks = conversations[c]
        rows = _rows(blocks, 384)
        state = model.new_state()
        model.extend(state, tokens[:376])
        state = CacheState(length=376, window_rows=state.window_rows, kv_rows=dict(rows.kv_rows),
                           index_rows=dict(rows.index_rows))
        fused, static = state.clone(), state.clone()
        logits = model.extend(fused, tokens[376:384], tail_prefill=False)
        model.graphs = True
        try:
            steps = model.step_graphs().steps
            got = model.extend(static, tokens[376:384], tail_prefill=False)
            assert model.step_graphs().steps == steps + 1
        finally:
            model.graphs = False
        _assert_same((fused, logits), (static, got))


class _Recorder(TorchDispatchMode):
    """Records the aten ops a segment runs, as a CUDA graph records its kernels (what _FakeGraph replays)."""

    def __init__(self, ops: list[Any]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func.overloadpacket) in HOST_READS:
            raise RuntimeError(f"{func} reads the device back to the host: a CUDA graph capture would fail")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class _FakeGraph:
    """A CPU stand-in for torch.cuda.CUDAGraph: replay re-runs the recorded ops on the recorded tensors and
    writes each result into the tensor the capture made (fixed addresses), without the segment's Python."""

    def __init__(self) -> None:
        self.ops: list[Any] = []

    def replay(self) -> None:
        from torch.utils._pytree import tree_leaves

        for func, args, kwargs, out in self.ops:
            schema = func._schema
            if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
                func(*args, **kwargs)  # in place or out=: the same tensors again
            elif any(r.alias_info is not None for r in schema.returns):
                continue  # a view: it still aliases what it viewed
            else:
                for old, new in zip(tree_leaves(out), tree_leaves(func(*args, **kwargs)), strict=True):
                    if isinstance(old, torch.Tensor):
                        old.copy_(new)


class _FakeCapture:
    def __init__(self, graph: _FakeGraph, **_: Any) -> None:
        self.mode = _Recorder(graph.ops)

    def __enter__(self) -> None:
        self.mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


class _FakeStream:
    def __init__(self, device: Any = None) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


def test_captured_replays_on_the_cpu(monkeypatch: pytest.MonkeyPatch, conversations: Any) -> None:
    """The capture path (warm-up, one graph per segment, replays with the eager selection between them) with
    torch.cuda's graphs replaced by replays of the recorded aten ops: two conversations at two H through one
    captured bucket, each equal to the fused step. Fails on a host read inside a segment, on Python state a
    replay needs that only the capture run set, and on a buffer a replay does not refresh."""
    import contextlib

    from replay.model.graphs import StepGraphs

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _FakeCapture)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    model = ReferenceModel(TINY_MODEL, batch_invariant=False)
    model._step_graphs = StepGraphs(model, capture=True)
    for c, h in ((0, 384), (1, 384), (1, 320), (0, 320)):
        tokens, blocks = conversations[c]
        fused = _replay(model, False, tokens, _rows(blocks, h), 8)
        _assert_same(fused, _replay(model, True, tokens, _rows(blocks, h), 8))
    (bucket,) = model.step_graphs().buckets.values()
    # captured at the key's second step (the first is the eager fused step's): three replays of the graphs
    assert len(bucket.graphs) == len(TINY_MODEL.index_layers) + 1 and model.step_graphs().steps == 3
