"""The model's numeric primitives (replay.model.ops): row invariance and a canonical top-k."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from replay.model import ops  # noqa: E402


def test_topk_is_canonical_and_blind_beyond_the_horizon() -> None:
    """Ties go to the lower row, indices come out ascending with unused slots last (index 0, masked),
    and rows beyond a query's horizon never change its choice, however high they score."""
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 9.0, 9.0]])
    idx, ok = ops.select_topk(scores, torch.tensor([8]), 4)
    assert idx.tolist() == [[0, 1, 2, 4]] and ok.all()
    short, _ = ops.select_topk(scores[:, :8], torch.tensor([8]), 4)
    assert torch.equal(short, idx)
    idx, ok = ops.select_topk(scores, torch.tensor([3]), 4)
    assert idx.tolist() == [[0, 1, 2, 0]] and ok.tolist() == [[True, True, True, False]]


def test_many_tied_rows_keep_the_lowest_indices() -> None:
    """A long run of equal scores (relu zeros are common) selects the first k rows."""
    scores = torch.zeros(3, 300)
    idx, ok = ops.select_topk(scores, torch.tensor([300, 200, 70]), 64)
    assert ok.all()
    assert all(row == list(range(64)) for row in idx.tolist())


def test_linear_rows_do_not_depend_on_the_batch() -> None:
    """The invariant linear gives each row the same bits alone as in a batch of any size."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 96, generator=gen), torch.randn(200, 96, generator=gen)
    full = ops.linear(x, w, invariant=True)
    assert all(torch.equal(ops.linear(x[i:i + 1], w, invariant=True), full[i:i + 1]) for i in range(37))
    assert torch.allclose(ops.linear(x, w, invariant=False), full, atol=1e-4)


def test_attention_sink_and_masks() -> None:
    """Masked slots weigh exactly 0; with every slot masked only the sink remains (output 0)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 32, generator=gen), torch.randn(2, 5, 32, generator=gen)
    sink = torch.zeros(3)
    valid = torch.tensor([[True, True, False, False, False], [False] * 5])
    out = ops.attend([(q, k, valid)], sink, invariant=True)
    assert torch.equal(out[1], torch.zeros(3, 32))
    scrambled = k.clone()
    scrambled[0, 2:] = 1e3  # masked keys: any value
    assert torch.equal(ops.attend([(q, scrambled, valid)], sink, invariant=True)[0], out[0])
    fast = ops.attend([(q, k, valid)], sink, invariant=False)
    assert torch.allclose(fast, out, atol=1e-5)
