"""Another layer pattern than the tiny fixture's: three kv sources (two of ratio 2, so a two-layer raw
tail), index layers defaulting to the sources, window-only layers at the bottom, as V4.1 has."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.geometry import ModelGeometry  # noqa: E402
from replay.model import ModelConfig, ReferenceModel  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks, state_snapshot  # noqa: E402

#: V4.1's shape in miniature: layers 0-1 window only, 2 and 4 ratio-2 sources (3 and 5 read them),
#: 6 a ratio-1 source read by 7.
GEOMETRY = ModelGeometry(name="mini-v41", num_layers=8, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1),
                         kv_source_layers=(2, 4, 6), window=8, head_dim=64, rope_head_dim=16, index_head_dim=32)
CONFIG = ModelConfig(geometry=GEOMETRY, vocab_size=64, dim=64, n_heads=2, index_topk=8, mlp_hidden=64, seed=4)


def test_chunking_and_an_odd_restore_are_exact(same_rows: Any) -> None:
    """Token by token == one call; a snapshot at odd T = 33 (two ratio-2 tails) restored over rows that
    stop at T continues exactly; index layers default to the sources."""
    assert CONFIG.index_layers == (2, 4, 6)
    model = ReferenceModel(CONFIG)
    tokens = torch.randint(0, 64, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    one = model.new_state()
    logits = model.extend(one, tokens)
    step = model.new_state()
    assert torch.equal(torch.cat([model.extend(step, [t]) for t in tokens]), logits)
    assert same_rows(one, step)

    at33 = model.new_state()
    model.extend(at33, tokens[:33])
    assert at33.tail is not None and at33.tail.shape == (2, 2, 64)
    restored = restore_state(GEOMETRY, state_blocks(GEOMETRY, one, 16), state_snapshot(GEOMETRY, at33),
                             position=33, resume=33, device="cpu")
    for s, keep in ((2, 16), (4, 16), (6, 33)):  # the rows a state at 33 holds: pair (32, 33) still open
        restored.kv_rows[s], restored.index_rows[s] = restored.kv_rows[s][:keep], restored.index_rows[s][:keep]
    assert same_rows(restored, at33)
    assert torch.equal(model.extend(restored, tokens[33:]), logits[33:])
    assert same_rows(restored, one)


def test_odd_resume_below_the_snapshot_needs_the_open_pairs_row() -> None:
    """With only ratio-2 sources, blocks can end one pair short of an odd R = T - 1: refused (the
    snapshot has no tail for pair (R - 1, R)); one more block and the resume continues exactly."""
    geometry = ModelGeometry(name="pairs-only", num_layers=2, compress_ratios=(0, 2), kv_source_layers=(1,),
                             window=4, head_dim=32, rope_head_dim=8, index_head_dim=32)
    model = ReferenceModel(ModelConfig(geometry=geometry, vocab_size=32, dim=32, n_heads=1, index_topk=4,
                                       mlp_hidden=32))
    tokens = list(range(3, 15))
    state = model.new_state()
    model.extend(state, tokens[:8])
    snap = state_snapshot(geometry, state)
    full = model.extend(state.clone(), tokens[8:])
    with pytest.raises(InvalidArgument, match="pair"):
        restore_state(geometry, state_blocks(geometry, state, 2)[:3], snap, position=8, resume=7, device="cpu")
    ok = restore_state(geometry, state_blocks(geometry, state, 2), snap, position=8, resume=7, device="cpu")
    assert torch.equal(model.extend(ok, tokens[7:])[1:], full)
