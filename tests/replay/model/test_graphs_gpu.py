"""The bounded replay step captured in CUDA graphs (replay.model.graphs) against the eager fused step, on CUDA.

torch.equal on the same device: the replay's logits, window rows and tail, and the logits of a
continuation, for several inputs replayed through one captured bucket (different tokens, rows and H),
so a buffer that kept the previous input fails. Skipped without a CUDA device.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from replay.model import TINY_MODEL, CacheState, ReferenceModel, reduced_v41  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK = 64
PREFIX = 3072


def _replay(model: ReferenceModel, graphs: bool, tokens: list[int], rows: CacheState,
            span: int) -> tuple[CacheState, Any]:
    model.graphs = graphs
    try:
        return model.replay_logits(tokens, rows, span=span)
    finally:
        model.graphs = True


def _assert_same(a: tuple[CacheState, Any], b: tuple[CacheState, Any]) -> None:
    (sa, la), (sb, lb) = a, b
    assert la.is_cuda and torch.equal(la, lb)
    assert sa.length == sb.length
    assert all(torch.equal(x, y) for x, y in zip(sa.window_rows, sb.window_rows, strict=True))
    assert (sa.tail is None) == (sb.tail is None)
    assert sa.tail is None or sb.tail is None or torch.equal(sa.tail, sb.tail)


@pytest.fixture(scope="module")
def reduced() -> tuple[ReferenceModel, list[tuple[list[int], Any]]]:
    """reduced_v41(dim=256) on CUDA and two conversations' blocks of their first 3,072 tokens."""
    cfg = reduced_v41(dim=256)
    model = ReferenceModel(cfg, device="cuda")
    convs = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (PREFIX + 64,), generator=gen).tolist()
        state = model.new_state()
        model.extend(state, tokens[:PREFIX], chunk=1024)
        convs.append((tokens, state_blocks(cfg.geometry, state, BLOCK)))
    return model, convs


def test_graphs_are_the_cuda_default() -> None:
    model = ReferenceModel(TINY_MODEL, device="cuda")
    assert model.graphs and model.fused and not model.batch_invariant


def test_captured_replay_equals_the_eager_step_for_several_inputs(reduced: Any) -> None:
    """V4.1's pattern (40 layers, window 128, top-k 512): bounded replays of 128 tokens at H = 2,048, 2,560
    and 3,072 of two conversations, all through one captured bucket, each torch.equal to the eager fused
    step; then a 9-token continuation from either state computes the same logits."""
    model, convs = reduced
    g = model.config.geometry
    steps = model.step_graphs()
    steps.buckets.clear()
    steps.seen.clear()
    built, taken = steps.built, steps.steps
    runs = [(c, h) for h in (2048, 2560, 3072) for c in (0, 1)] + [(0, 2048)]
    for c, h in runs:
        tokens, blocks = convs[c]

        def rows(h: int = h, blocks: Any = blocks) -> CacheState:
            return restore_state(g, blocks[:h // BLOCK], None, position=h, resume=h, device="cuda")

        eager = _replay(model, False, tokens, rows(), g.window)
        graph = _replay(model, True, tokens, rows(), g.window)
        _assert_same(eager, graph)
        model.graphs = False
        assert torch.equal(model.extend(eager[0], tokens[h:h + 9]), model.extend(graph[0], tokens[h:h + 9]))
        model.graphs = True
    # the bucket's first step is the eager one (a capture pays only when reused); the next six its graphs'
    assert steps.built == built + 1 and steps.steps == taken + len(runs) - 1
    (bucket,) = steps.buckets.values()
    assert bucket.capture and len(bucket.graphs) == len(model.config.index_layers) + 1


def test_captured_replay_at_an_odd_h(reduced: Any) -> None:
    """An odd H (the tail of the ratio-2 sources) and a span of 2 windows, through the graphs."""
    model, convs = reduced
    tokens, _ = convs[0]
    state = model.new_state()
    model.extend(state, tokens[:2049], chunk=1024)
    w = model.config.geometry.window
    taken = model.step_graphs().steps
    for span in (w, 2 * w, w, 2 * w):  # each key's second step is its graphs'
        eager = _replay(model, False, tokens, state.clone(), span)
        graph = _replay(model, True, tokens, state.clone(), span)
        assert graph[0].tail is not None
        _assert_same(eager, graph)
    assert model.step_graphs().steps == taken + 2


def test_tiny_model_captured_replays() -> None:
    """The tiny fixture on CUDA: H where the index keeps fewer slots than top-k and where it keeps them all."""
    model = ReferenceModel(TINY_MODEL, device="cuda")
    g = TINY_MODEL.geometry
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (400,), generator=gen).tolist()
    state = model.new_state()
    model.extend(state, tokens[:384])
    blocks = state_blocks(g, state, 4)
    for h in (384, 320, 384, 40, 40):
        for span in (8, 16):
            def rows(h: int = h) -> CacheState:
                return restore_state(g, blocks[:h // 4], None, position=h, resume=h, device="cuda")

            _assert_same(_replay(model, False, tokens, rows(), span), _replay(model, True, tokens, rows(), span))
    assert model.step_graphs().steps == 6  # each key's first step is eager
