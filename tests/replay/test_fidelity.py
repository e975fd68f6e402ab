"""replay/fidelity.py: the metrics on known inputs, and on the tiny model (CPU, batch invariant)."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from kvstore.codec.rows import swa_rows  # noqa: E402
from replay.fidelity import (  # noqa: E402
    Summary,
    compare_logits,
    kl_divergence,
    measure,
    reference,
    window_errors,
)


def test_logits_of_themselves_agree_fully() -> None:
    x = torch.randn(128, generator=torch.Generator().manual_seed(1))
    got = compare_logits(x, x.clone())
    assert got.cosine == 1.0 and got.max_diff_of_range == 0.0 and got.top1


def test_max_diff_is_relative_to_the_exact_logits_range() -> None:
    exact = torch.tensor([0.0, 1.0, 4.0, -4.0])
    approx = exact.clone()
    approx[1] += 0.4
    got = compare_logits(approx, exact)
    assert got.max_diff_of_range == pytest.approx(0.4 / 8.0)
    assert got.top1  # the largest stays at index 2
    approx[3] = 10.0
    got = compare_logits(approx, exact)
    assert not got.top1
    assert got.max_diff_of_range == pytest.approx(14.0 / 8.0)  # the exact side's range, not the approximation's


def test_kl_is_zero_on_equal_logits_and_measured_from_the_exact_side() -> None:
    e = torch.log(torch.tensor([[0.5, 0.5]]))
    a = torch.log(torch.tensor([[0.9, 0.1]]))
    assert float(kl_divergence(e, e)[0]) == 0.0
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(exact || approx), not the reverse
    assert float(kl_divergence(a, e)[0]) == pytest.approx(want)


def test_window_error_is_relative_per_layer() -> None:
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    exact = [swa_rows(x), swa_rows(x)]
    # Scales are powers of two, so the rows of 2x decode to exactly twice those of x: error 1.
    approx = [swa_rows(x), swa_rows(2 * x)]
    assert window_errors(approx, exact) == [0.0, pytest.approx(1.0)]
    with pytest.raises(ValueError, match="layer 1"):
        window_errors([exact[0], exact[1][:4]], exact)


@pytest.fixture(scope="module")
def tiny() -> object:
    pytest.importorskip("replay.model")
    from replay.model import TINY_MODEL, ReferenceModel

    return ReferenceModel(TINY_MODEL, device="cpu")


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in torch.randint(32, 127, (n,), generator=torch.Generator().manual_seed(seed))]


def _exact_and_rows(model: object, tokens: list[int], h: int) -> tuple[object, object]:
    from replay.model.cache_io import restore_state, state_blocks

    g = model.config.geometry  # type: ignore[attr-defined]
    cold = model.new_state()  # type: ignore[attr-defined]
    model.extend(cold, tokens[:h])  # type: ignore[attr-defined]
    blocks = state_blocks(g, cold, 4)
    return cold, restore_state(g, blocks, None, position=h, resume=h, device="cpu")


def test_exact_against_exact_is_perfect(tiny: object) -> None:
    tokens = _tokens(70)
    h = 56
    cold, rows = _exact_and_rows(tiny, tokens, h)
    g = tiny.config.geometry  # type: ignore[attr-defined]
    exact = tiny.replay(tokens[:h], rows, span=g.num_layers * g.window)  # type: ignore[attr-defined]
    ref = reference(tiny, copy.deepcopy(exact), tokens[h:], steps=6)  # type: ignore[arg-type]
    assert len(ref.tokens) == 6 and ref.step_logits.shape == (6, 128)
    got = measure(tiny, cold, ref, tokens[h:])  # type: ignore[arg-type]
    assert got.window_errors == [0.0] * g.num_layers and got.window_errors_after == [0.0] * g.num_layers
    assert got.logits.cosine == 1.0 and got.logits.max_diff_of_range == 0.0 and got.logits.top1
    assert got.continuation is not None
    assert got.continuation.kl_max == 0.0 and got.continuation.top1_agreement == 1.0


def test_bounded_replay_differs_and_the_summary_says_so(tiny: object) -> None:
    tokens = _tokens(70, seed=3)
    h = 56
    _, rows = _exact_and_rows(tiny, tokens, h)
    g = tiny.config.geometry  # type: ignore[attr-defined]
    exact = tiny.replay(tokens[:h], rows, span=g.num_layers * g.window)  # type: ignore[attr-defined]
    bounded = tiny.replay(tokens[:h], rows, span=g.window)  # type: ignore[attr-defined]
    ref = reference(tiny, copy.deepcopy(exact), tokens[h:], steps=4)  # type: ignore[arg-type]
    got = measure(tiny, bounded, ref, tokens[h:])  # type: ignore[arg-type]
    assert got.window_errors[0] == 0.0  # layer 0 sees only its window: W tokens replay it exactly
    assert max(got.window_errors) > 0.0
    assert got.continuation is not None and got.continuation.kl_mean > 0.0
    assert got.logits.cosine < 1.0
    summary = Summary(name="bounded")
    summary.add(got)
    d = summary.to_dict()
    assert d["samples"] == 1 and d["kl_mean"] == got.continuation.kl_mean
    assert d["window_error_per_layer"] == got.window_errors
    assert d["window_error_max"] == max(got.window_errors)
