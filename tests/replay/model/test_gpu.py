"""The model on CUDA (batch_invariant=False: matmul path, TF32 off). Skipped without a CUDA device."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from replay.model import TINY_MODEL, ReferenceModel, reduced_v41  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks, state_snapshot  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATOL = 3e-3


def test_tiny_on_cuda_matches_the_cpu_run(run: Any) -> None:
    """Prefill, restore from blocks + snapshot and continue on CUDA: allclose to the CPU run."""
    model = ReferenceModel(TINY_MODEL, device="cuda")
    assert not model.batch_invariant
    state = model.new_state()
    logits = model.extend(state, run.tokens[:64])
    assert torch.allclose(logits.cpu(), run.logits[:64], atol=ATOL, rtol=0)
    g = TINY_MODEL.geometry
    restored = restore_state(g, state_blocks(g, state, 16).cpu(), state_snapshot(g, state), position=64, resume=64,
                             device="cuda")
    rest = model.extend(restored, run.tokens[64:])
    assert torch.allclose(rest.cpu(), run.logits[64:], atol=ATOL, rtol=0)
    train = model.forward_train(torch.tensor([run.tokens], device="cuda")).detach()
    assert torch.allclose(train[0].cpu(), run.logits, atol=ATOL, rtol=0)


def test_reduced_v41_replays_over_loaded_rows() -> None:
    """V4.1's pattern (40 layers, head_dim 512, window 128): prefill 2,048 tokens, then a bounded replay
    of 128 over the loaded rows lands at the same length with full windows."""
    cfg = reduced_v41(dim=256)
    model = ReferenceModel(cfg, device="cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2048,), generator=gen).tolist()
    state = model.new_state()
    model.extend(state, tokens, chunk=1024)
    g = cfg.geometry
    rows = restore_state(g, state_blocks(g, state, 64), None, position=0, resume=2048, device="cuda")
    replayed = model.replay(tokens, rows, span=g.window)
    assert replayed.length == 2048 and all(w.shape[0] == g.window for w in replayed.window_rows)
    assert torch.equal(replayed.kv_rows[20], state.kv_rows[20])
