"""A state through the store's bytes and back (replay.model.cache_io): restoring and continuing
gives exactly what continuing the in-memory state gives."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore.codec.block_codec import split_blocks  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.swa_snapshot import snapshot_bytes  # noqa: E402
from replay.model import TINY_MODEL, ReferenceModel  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks, state_snapshot  # noqa: E402

G = TINY_MODEL.geometry
BLOCK = 16


def test_blocks_and_snapshot_have_the_store_sizes(run: Any) -> None:
    """state_blocks gives the full blocks (from start_block), state_snapshot snapshot_bytes(T) bytes."""
    state = run.states[63]
    blocks = state_blocks(G, state, BLOCK)
    assert blocks.shape == (3, G.block_bytes(BLOCK)) and blocks.dtype == torch.uint8
    assert state_blocks(G, state, BLOCK, start_block=2).shape[0] == 1
    assert state_blocks(G, state, BLOCK, start_block=3).shape[0] == 0
    rows = split_blocks(G, blocks, BLOCK)
    assert torch.equal(rows[3][0].reshape(-1, G.compressed_kv_row_bytes), state.kv_rows[3][:48])
    for t in (49, 64):
        assert len(state_snapshot(G, run.states[t])) == snapshot_bytes(G, t)


def test_restore_from_blocks_and_snapshot_then_extend_equals_continuing(tiny: ReferenceModel, run: Any,
                                                                        same_rows: Any) -> None:
    """Blocks [0, 64) + the snapshot at 64 -> the state at 64, byte for byte; extending it gives the
    cold run's logits exactly."""
    blocks = state_blocks(G, run.states[64], BLOCK)
    snap = state_snapshot(G, run.states[64])
    state = restore_state(G, blocks, snap, position=64, resume=64, device="cpu")
    assert state.rows_floor == 64
    assert same_rows(state, run.states[64])
    assert torch.equal(tiny.extend(state, run.tokens[64:96]), run.logits[64:96])
    assert same_rows(state, run.states[96])
    # blocks as a list of bytes (what a client hands over) restore the same rows
    listed = restore_state(G, [bytes(b.numpy()) for b in blocks], snap, position=64, resume=64, device="cpu")
    assert same_rows(listed, run.states[64])


def test_resume_at_t_minus_1_from_an_even_snapshot(tiny: ReferenceModel, run: Any, same_rows: Any) -> None:
    """The snapshot at even T = 64 serves R = 63: the window drops position 63, the open pair's row is the
    loaded one, and recomputing position 63 onwards gives the cold logits bit for bit."""
    blocks = state_blocks(G, run.states[64], BLOCK)
    state = restore_state(G, blocks, state_snapshot(G, run.states[64]), position=64, resume=63, device="cpu")
    assert state.length == 63 and state.tail is None
    assert all(torch.equal(w, c[:-1]) for w, c in zip(state.window_rows, run.states[64].window_rows, strict=True))
    assert torch.equal(tiny.extend(state, run.tokens[63:96]), run.logits[63:96])
    assert same_rows(state, run.states[96])


def test_odd_length_tail_round_trips_through_the_snapshot(tiny: ReferenceModel, run: Any, same_rows: Any) -> None:
    """A snapshot at odd T = 49 carries the raw tail; restored with rows that end at T (pair (48, 49) not
    written yet), the next position completes the pair exactly; without the tail it cannot, and a wrong
    tail gives another row."""
    snap = state_snapshot(G, run.states[49])
    blocks = state_blocks(G, run.states[64], BLOCK)

    def restored(tail: Any = "keep") -> Any:
        state = restore_state(G, blocks, snap, position=49, resume=49, device="cpu")
        state.kv_rows[1], state.index_rows[1] = state.kv_rows[1][:24], state.index_rows[1][:24]
        state.kv_rows[3], state.index_rows[3] = state.kv_rows[3][:49], state.index_rows[3][:49]
        if tail != "keep":
            state.tail = tail
        return state

    state = restored()
    assert state.tail is not None and torch.equal(state.tail, run.states[49].tail)
    assert same_rows(state, run.states[49])
    assert torch.equal(tiny.extend(state, run.tokens[49:64]), run.logits[49:64])
    assert same_rows(state, run.states[64])
    tailless = restored(None)
    with pytest.raises(InvalidArgument, match="raw tail"):
        tiny.extend(tailless, run.tokens[49:51])
    assert same_rows(tailless, restored(None))  # refused before anything was written
    wrong = restored(torch.zeros_like(run.states[49].tail))
    tiny.extend(wrong, run.tokens[49:51])
    assert not torch.equal(wrong.kv_rows[1][24], run.states[64].kv_rows[1][24])


def test_loaded_rows_are_never_rewritten(tiny: ReferenceModel, run: Any) -> None:
    """Rows from the blocks are authoritative: a resume at 63 recomputes position 63 but keeps the
    loaded row of pair (62, 63), here altered, and so does a replay of [48, 64)."""
    blocks = state_blocks(G, run.states[64], BLOCK).clone()
    kv_at = G.block_layout(BLOCK)[0]  # layer 1's compressed-KV rows come first in a block
    row_31 = kv_at.offset + 7 * kv_at.row_bytes  # in block 3: row 7 of layer 1 = row 31 = pair (62, 63)
    blocks[3, row_31:row_31 + kv_at.row_bytes] ^= 0x11
    altered = split_blocks(G, blocks, BLOCK)[1][0].reshape(-1, G.compressed_kv_row_bytes)[31].clone()
    assert not torch.equal(altered, run.states[64].kv_rows[1][31])

    state = restore_state(G, blocks, state_snapshot(G, run.states[64]), position=64, resume=63, device="cpu")
    tiny.extend(state, run.tokens[63:70])
    assert torch.equal(state.kv_rows[1][31], altered)
    # nothing appended twice either: rows 32..34 are the new pairs, as the cold run has them
    assert state.kv_rows[1].shape[0] == 35 and state.index_rows[1].shape[0] == 35
    assert torch.equal(state.kv_rows[1][32:], run.states[96].kv_rows[1][32:35])
    assert torch.equal(state.kv_rows[1][:32], restore_state(G, blocks, None, position=0, resume=64,
                                                            device="cpu").kv_rows[1])

    rows = restore_state(G, blocks, None, position=0, resume=64, device="cpu")
    replayed = tiny.replay(run.tokens, rows, span=16)
    assert torch.equal(replayed.kv_rows[1][31], altered)
    for s in G.kv_source_layers:  # every source keeps exactly the loaded rows: none rewritten, none added
        assert torch.equal(replayed.kv_rows[s], rows.kv_rows[s])
        assert torch.equal(replayed.index_rows[s], rows.index_rows[s])


def test_restore_refuses_what_it_cannot_serve(run: Any) -> None:
    """A snapshot that does not serve R, blocks short of R, or an odd R < T whose pair row is missing."""
    snap = state_snapshot(G, run.states[64])
    blocks = state_blocks(G, run.states[64], BLOCK)
    with pytest.raises(InvalidArgument, match="does not serve"):
        restore_state(G, blocks, snap, position=64, resume=60, device="cpu")
    with pytest.raises(InvalidArgument, match="rows of every position"):
        restore_state(G, blocks[:3], snap, position=64, resume=64, device="cpu")
    with pytest.raises(InvalidArgument):
        restore_state(G, blocks, b"\0" * 10, position=64, resume=64, device="cpu")


def test_snapshot_needs_a_full_window(tiny: ReferenceModel, run: Any) -> None:
    """A state restored at T - 1 holds window - 1 rows: no snapshot until it has extended."""
    state = restore_state(G, state_blocks(G, run.states[64], BLOCK), state_snapshot(G, run.states[64]),
                          position=64, resume=63, device="cpu")
    with pytest.raises(InvalidArgument, match="window rows"):
        state_snapshot(G, state)
    tiny.extend(state, run.tokens[63:64])
    assert state_snapshot(G, state) == state_snapshot(G, run.states[64])
