"""forward_train (dense, batched, differentiable) and the fast matmul path agree with extend; weights
save and load."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import InvalidArgument  # noqa: E402
from replay.model import TINY_MODEL, ReferenceModel  # noqa: E402

#: Float32 rounding differs between the paths; once in a while a value then lands on the other side
#: of an FP4/FP8 rounding edge, which moves a logit by ~1e-3 at most on the tiny fixture.
ATOL = 3e-3


def test_forward_train_matches_extend(tiny: ReferenceModel, run: Any, make_tokens: Any) -> None:
    """A batch of two sequences through forward_train gives each one's extend logits (allclose)."""
    other = make_tokens(150, seed=5)
    logits = tiny.forward_train(torch.tensor([run.tokens, other])).detach()
    assert logits.shape == (2, 150, TINY_MODEL.vocab_size)
    assert torch.allclose(logits[0], run.logits, atol=ATOL, rtol=0)
    assert torch.allclose(logits[1], tiny.extend(tiny.new_state(), other), atol=ATOL, rtol=0)
    assert float((logits[0] - run.logits).abs().mean()) < 1e-5


def test_forward_train_is_differentiable_through_the_quantizers(make_tokens: Any) -> None:
    """Gradients reach the window-KV, compressor and query weights (straight-through fake quant)."""
    model = ReferenceModel(TINY_MODEL)
    tokens = torch.tensor([make_tokens(40, seed=2)])
    logits = model.forward_train(tokens)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])
    loss.backward()
    for name in ("wkv", "wc", "wg", "wq", "w1"):
        grad = getattr(model.blocks[1], name).grad
        assert grad is not None and float(grad.abs().sum()) > 0, name
    assert model.embed.grad is not None and float(model.embed.grad.abs().sum()) > 0


def test_fast_path_matches_the_invariant_one(run: Any, same_rows: Any) -> None:
    """batch_invariant=False (matmul/bmm, the CUDA path) runs on the CPU too and agrees (allclose),
    chunked or not, with the same selections and nearly all the same row bytes."""
    fast = ReferenceModel(TINY_MODEL, batch_invariant=False)
    state = fast.new_state()
    logits = torch.cat([fast.extend(state, run.tokens[:100], chunk=33), fast.extend(state, run.tokens[100:])])
    assert torch.allclose(logits, run.logits, atol=ATOL, rtol=0)
    same = sum(int(torch.equal(a, b)) for a, b in zip(state.kv_rows[3], run.states[150].kv_rows[3], strict=True))
    assert same >= 0.9 * 150


def test_weights_save_and_load(tmp_path: Path, run: Any) -> None:
    """save_weights then load_weights into a model of another seed gives the same logits; a file of
    another shape is refused."""
    path = tmp_path / "tiny.pt"
    source = ReferenceModel(TINY_MODEL)
    source.save_weights(path)
    other = ReferenceModel(replace(TINY_MODEL, seed=7))
    other.load_weights(path)
    assert torch.equal(other.extend(other.new_state(), run.tokens[:20]), run.logits[:20])
    wider = ReferenceModel(replace(TINY_MODEL, mlp_hidden=64))
    with pytest.raises(InvalidArgument, match="another model"):
        wider.load_weights(path)
