"""The fused, sync-free step (replay.model.fast; batch_invariant=False, the CUDA default), on the CPU.

It must agree with the batch-invariant run (allclose) and with the per-layer step it replaces
(`fused = False`), make no host sync inside the layer loop (one per step: the rows' NaN check),
still refuse NaN, and follow weight changes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvstore.errors import InvalidArgument  # noqa: E402
from replay.model import TINY_MODEL, ReferenceModel  # noqa: E402
from replay.model.cache_io import restore_state, state_blocks  # noqa: E402
from replay.model.state import FloatRows  # noqa: E402

ATOL = 3e-3
#: aten ops that read a device value back to the host (each a sync on CUDA).
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select")


class _Ops(TorchDispatchMode):
    """Counts the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> int:
        return sum(self.ops[name] for name in HOST_READS)


def _fast(**kw: Any) -> ReferenceModel:
    model = ReferenceModel(replace(TINY_MODEL, **kw) if kw else TINY_MODEL, batch_invariant=False)
    assert model.fused
    return model


def _nearly_the_same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, at most one byte in 64 differing, none in 9 of 10 rows.

    The fused step sums in another order than the batch-invariant run, so a value on an FP8 code's
    boundary may round the other way: on an AVX-512 host one byte of one window row in 8 did.
    """
    if a.shape != b.shape:
        return False
    differ = (a != b).reshape(a.shape[0], -1)
    return int(differ.sum()) * 64 <= differ.numel() and int(differ.any(1).sum()) * 10 <= a.shape[0] + 9


def test_fused_step_matches_the_invariant_run(run: Any, same_rows: Any) -> None:
    """Chunked at odd lengths (raw tails carried between calls): allclose logits and tail, nearly the
    same window bytes, nearly all the same compressed rows; and the per-layer step it replaces agrees as closely."""
    fused, reference = _fast(), _fast()
    reference.fused = False
    for model in (fused, reference):
        state = model.new_state()
        logits = torch.cat([model.extend(state, run.tokens[a:b], chunk=33)
                            for a, b in ((0, 49), (49, 100), (100, 149))])
        assert torch.allclose(logits, run.logits[:149], atol=ATOL, rtol=0)
        truth = run.states[150]
        assert state.length == 149 and state.tail is not None
        model.extend(state, run.tokens[149:])
        for a, b in zip(state.window_rows, truth.window_rows, strict=True):
            assert _nearly_the_same_bytes(a, b), (int((a != b).sum()), a.shape)
        for s in TINY_MODEL.geometry.kv_source_layers:
            same = sum(int(torch.equal(a, b)) for a, b in zip(state.kv_rows[s], truth.kv_rows[s], strict=True))
            assert state.kv_rows[s].shape == truth.kv_rows[s].shape and same >= 0.9 * truth.kv_rows[s].shape[0]


def test_fused_replay_matches_the_invariant_replay(tiny: ReferenceModel, run: Any) -> None:
    """A bounded replay over restored rows, then the rest of the run: allclose to the invariant model's."""
    g = TINY_MODEL.geometry
    model = _fast()
    rows = restore_state(g, state_blocks(g, run.states[96], 16), None, position=96, resume=96, device="cpu")
    for span in (g.window, 2 * g.window, 96):
        ours, theirs = model.replay(run.tokens, rows, span=span), tiny.replay(run.tokens, rows, span=span)
        assert ours.length == theirs.length == 96
        assert all(torch.equal(a, b) for a, b in zip(ours.window_rows, theirs.window_rows, strict=True))
        assert torch.allclose(model.extend(ours, run.tokens[96:]), tiny.extend(theirs, run.tokens[96:]),
                              atol=ATOL, rtol=0)


def test_one_host_sync_per_step_and_none_in_the_layer_loop(run: Any) -> None:
    """Sizes come from Python ints, never from GPU values: a replay makes one host read (the rows' NaN
    check), an extend of three chunks three; the per-layer step it replaces makes dozens."""
    g = TINY_MODEL.geometry
    model = _fast()
    rows = restore_state(g, state_blocks(g, run.states[96], 16), None, position=96, resume=96, device="cpu")
    model.replay(run.tokens, rows, span=2 * g.window)  # packs built outside the count
    with _Ops() as counted:
        model.replay(run.tokens, rows, span=2 * g.window)
    assert counted.host_reads == 1, counted.ops
    with _Ops() as counted:
        model.extend(model.new_state(), run.tokens[:99], chunk=33)
    assert counted.host_reads == 3, counted.ops
    model.fused = False
    with _Ops() as counted:
        model.replay(run.tokens, rows, span=2 * g.window)
    assert counted.host_reads > 2 * g.num_layers


def test_fused_step_still_refuses_nan(run: Any) -> None:
    """The NaN check is deferred to the step's end, not dropped: a NaN weight is refused."""
    model = _fast()
    model.extend(model.new_state(), run.tokens[:8])
    with torch.no_grad():
        model.blocks[2].wkv[0, 0] = float("nan")
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        model.extend(model.new_state(), run.tokens[:8])


def test_packed_weights_follow_weight_changes(tmp_path: Path, run: Any) -> None:
    """The concatenated projections are rebuilt when a weight changes (load_weights, an in-place edit)."""
    source = _fast()
    path = tmp_path / "w.pt"
    source.save_weights(path)
    other = _fast(seed=7)
    before = other.extend(other.new_state(), run.tokens[:20])  # packs of seed 7's weights
    other.load_weights(path)
    assert torch.equal(other.extend(other.new_state(), run.tokens[:20]),
                       source.extend(source.new_state(), run.tokens[:20]))
    assert not torch.allclose(before, source.extend(source.new_state(), run.tokens[:20]))
    with torch.no_grad():  # a projection, a norm folded into the matmul after it, and the final norm
        for model in (other, source):
            model.blocks[0].w1.mul_(0.5)
            model.blocks[1].attn_norm.mul_(1.5)
            model.final_norm.mul_(2.0)
    assert torch.equal(other.extend(other.new_state(), run.tokens[:20]),
                       source.extend(source.new_state(), run.tokens[:20]))


def test_float_rows_append_only_when_in_step() -> None:
    """FloatRows.append records values that follow exactly the rows it holds, and ignores others
    (a copy that lags behind decodes them later)."""
    rows = torch.zeros((6, 72), dtype=torch.uint8)
    copy = FloatRows("kv")
    assert copy.values(rows[:2]).shape == (2, 128)
    copy.append(2, torch.ones((3, 128)))
    assert copy.count == 5 and torch.equal(copy.buf[2:5], torch.ones((3, 128)))
    copy.append(4, torch.full((1, 128), 2.0))  # not in step: ignored
    assert copy.count == 5
    assert torch.equal(copy.values(rows)[5], torch.zeros(128))
