"""ReferenceModel.extend / replay on the tiny fixture (CPU, batch invariant).

Every comparison is torch.equal: the model's arithmetic is row-invariant, so a
position's outputs never depend on how positions were chunked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import InvalidArgument  # noqa: E402
from replay.model import TINY_MODEL, ReferenceModel  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks  # noqa: E402

BLOCK = 16


def test_one_call_chunked_and_token_by_token_give_the_same_bits(tiny: ReferenceModel, run: Any,
                                                                same_rows: Any) -> None:
    """Batch invariance: one extend == internal chunks of 7 == 150 extends of one token (logits and bytes),
    with more compressed rows than index_topk for both kv sources."""
    assert run.states[150].kv_rows[1].shape[0] > TINY_MODEL.index_topk  # ratio 2: 75 rows
    one = tiny.new_state()
    logits = tiny.extend(one, run.tokens)
    assert torch.equal(logits, run.logits)
    assert same_rows(one, run.states[150])

    chunked = tiny.new_state()
    assert torch.equal(tiny.extend(chunked, run.tokens, chunk=7), run.logits)
    assert same_rows(chunked, run.states[150])

    single = tiny.new_state()
    steps = torch.cat([tiny.extend(single, [t]) for t in run.tokens])
    assert torch.equal(steps, run.logits)
    assert same_rows(single, run.states[150])


def test_state_holds_rows_in_the_geometry_shapes(run: Any) -> None:
    """Rows per source (T/ratio), the last `window` window rows per layer, the tail only at odd T."""
    g = TINY_MODEL.geometry
    odd, even = run.states[49], run.states[64]
    assert [r.shape for r in even.window_rows] == [(g.window, g.window_row_bytes)] * g.num_layers
    assert even.kv_rows[1].shape == (32, g.compressed_kv_row_bytes)
    assert even.index_rows[3].shape == (64, g.indexer_row_bytes)
    assert even.tail is None
    assert odd.tail is not None and odd.tail.shape == (1, 2, g.head_dim)
    assert odd.kv_rows[1].shape[0] == 24  # pair (48, 49) is still open: its half is the tail


def test_topk_limits_attention_to_index_topk_rows(run: Any) -> None:
    """A query sees at most index_topk compressed rows: a model with a larger top-k (same weights)
    agrees while every query sees <= 64 rows and differs once more are visible."""
    wide = ReferenceModel(replace(TINY_MODEL, index_topk=160), device="cpu")
    logits = wide.extend(wide.new_state(), run.tokens)
    # layer 3 (ratio 1) sees p + 1 rows: up to position 63 all of them fit in 64 slots
    assert torch.allclose(logits[:64], run.logits[:64], atol=1e-5)  # longer key lists: another sum order
    assert not torch.allclose(logits[80:], run.logits[80:], atol=1e-4)


def test_replay_over_the_whole_prefix_equals_a_cold_run(tiny: ReferenceModel, run: Any, same_rows: Any) -> None:
    """replay with span >= H recomputes every position with the loaded rows kept: the cold state, bit for bit."""
    blocks = state_blocks(TINY_MODEL.geometry, run.states[64], BLOCK)
    rows = restore_state(TINY_MODEL.geometry, blocks, None, position=0, resume=64, device="cpu")
    state = tiny.replay(run.tokens, rows, span=100)
    assert same_rows(state, run.states[64])
    assert torch.equal(tiny.extend(state, run.tokens[64:96]), run.logits[64:96])


def test_bounded_replay_window_sees_nothing_below_its_start(tiny: ReferenceModel, run: Any,
                                                            make_tokens: Any) -> None:
    """Bounded replay of [H - span, H): its window state does not depend on tokens below H - span
    (the loaded rows carry those), is approximate for layers above 0, and leaves the rows alone."""
    g = TINY_MODEL.geometry
    h, span = 64, 16
    blocks = state_blocks(g, run.states[h], BLOCK)
    rows = restore_state(g, blocks, None, position=0, resume=h, device="cpu")
    bounded = tiny.replay(run.tokens, rows, span=span)
    other = make_tokens(h - span, seed=9) + run.tokens[h - span:h]
    again = tiny.replay(other, rows, span=span)
    assert all(torch.equal(a, b) for a, b in zip(bounded.window_rows, again.window_rows, strict=True))
    assert bounded.length == h and all(r.shape[0] == g.window for r in bounded.window_rows)
    # layer 0's window KV depends on its own token only; above it, attention saw a cut window
    assert torch.equal(bounded.window_rows[0], run.states[h].window_rows[0])
    assert not torch.equal(bounded.window_rows[g.num_layers - 1], run.states[h].window_rows[-1])
    assert all(torch.equal(bounded.kv_rows[s], rows.kv_rows[s]) for s in g.kv_source_layers)


def test_replay_refuses_a_bad_span(tiny: ReferenceModel, run: Any) -> None:
    """span < 1 or fewer tokens than the rows cover is InvalidArgument."""
    rows = restore_state(TINY_MODEL.geometry, state_blocks(TINY_MODEL.geometry, run.states[64], BLOCK), None,
                         position=0, resume=64, device="cpu")
    with pytest.raises(InvalidArgument):
        tiny.replay(run.tokens, rows, span=0)
    with pytest.raises(InvalidArgument):
        tiny.replay(run.tokens[:10], rows, span=8)


def test_greedy_feeds_each_token_and_returns_the_logits_it_chose_from(tiny: ReferenceModel, run: Any) -> None:
    """greedy == argmax then extend, token by token; logits[0] is the logits it was given."""
    state = run.states[64].clone()
    tokens, logits = tiny.greedy(state, run.logits[63], 5)
    assert tokens[0] == int(torch.argmax(run.logits[63])) and torch.equal(logits[0], run.logits[63])
    assert state.length == 69
    check = run.states[64].clone()
    again = tiny.extend(check, tokens)
    assert torch.equal(again[:4], logits[1:])
    assert tokens[1:] == [int(t) for t in torch.argmax(again[:4], dim=-1)]


def test_tail_prefill_cuts_the_layers_above_the_last_source(tiny: ReferenceModel, run: Any) -> None:
    """With tail prefill, layers above the last kv source compute only the last `window` positions:
    rows match a full prefill, the upper layers' window state covers the last window, logits are approximate."""
    g = TINY_MODEL.geometry
    state = tiny.new_state()
    logits = tiny.extend(state, run.tokens[:64], tail_prefill=True)
    full = run.states[64]
    assert logits.shape == (g.window, TINY_MODEL.vocab_size)
    assert all(torch.equal(state.kv_rows[s], full.kv_rows[s]) for s in g.kv_source_layers)
    for layer in range(TINY_MODEL.last_source + 1):
        assert torch.equal(state.window_rows[layer], full.window_rows[layer])
    assert state.window_rows[4].shape[0] == g.window
    assert not torch.equal(logits, run.logits[64 - g.window:64])
    cos = torch.nn.functional.cosine_similarity(logits, run.logits[64 - g.window:64], dim=-1)
    assert float(cos.min()) > 0.5
    # the upper layers' window restarts at the cut: what they held before the call is not seen
    before = run.states[49].clone()
    tampered = run.states[49].clone()
    tampered.window_rows[4] = torch.zeros_like(tampered.window_rows[4])
    assert torch.equal(tiny.extend(before, run.tokens[49:64], tail_prefill=True),
                       tiny.extend(tampered, run.tokens[49:64], tail_prefill=True))
    # a call no longer than the window computes everything: nothing is cut
    short = run.states[49].clone()
    assert torch.equal(tiny.extend(short, run.tokens[49:57], tail_prefill=True), run.logits[49:57])


def test_bad_tokens_are_refused(tiny: ReferenceModel) -> None:
    """Token ids outside the vocabulary raise InvalidArgument, and the state is untouched."""
    state = tiny.new_state()
    with pytest.raises(InvalidArgument):
        tiny.extend(state, [1, TINY_MODEL.vocab_size])
    assert state.length == 0


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    """Weights are seeded: the same seed gives the same bits."""
    a = ReferenceModel(TINY_MODEL).state_dict()
    b = ReferenceModel(TINY_MODEL).state_dict()
    c = ReferenceModel(replace(TINY_MODEL, seed=1)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])
