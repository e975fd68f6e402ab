"""Fixtures of the reference-model tests: the tiny model on the CPU and one reference run of it.

The run is computed once per session in a few `extend` calls, cloning the state
at the lengths the tests resume from; batch invariance (test_model.py) is what
lets every test compare against these logits with torch.equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from replay.model import TINY_MODEL, CacheState, ReferenceModel  # noqa: E402

#: Tokens of the reference run: past index_topk (64) rows for both kv sources of the tiny fixture.
RUN_TOKENS = 150
#: Lengths the run keeps a copy of its state at (odd, even, block boundaries of 16).
CHECKPOINTS = (49, 63, 64, 96)
#: Tokens per block in these tests (the server tests use 16 too).
BLOCK = 16


@dataclass
class Run:
    """A cold run: its tokens, every position's logits and the state at each checkpoint."""

    tokens: list[int]
    logits: Any  # float32 [RUN_TOKENS, vocab]
    states: dict[int, CacheState]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread while a model test runs: the tiny model's ops are too small to split, and
    on a loaded 2-core machine two spinning threads make them ~10x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny() -> ReferenceModel:
    """The tiny fixture model, seeded, batch invariant, on the CPU."""
    return ReferenceModel(TINY_MODEL, device="cpu")


def _make_tokens(n: int, seed: int = 1) -> list[int]:
    """n seeded token ids of the tiny vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_MODEL.vocab_size, (n,), generator=gen).tolist()


@pytest.fixture(scope="session")
def run(tiny: ReferenceModel) -> Run:
    """The reference run of RUN_TOKENS tokens."""
    tokens = _make_tokens(RUN_TOKENS)
    state = tiny.new_state()
    parts, states, at = [], {}, 0
    for stop in (*CHECKPOINTS, RUN_TOKENS):
        parts.append(tiny.extend(state, tokens[at:stop]))
        states[stop] = state.clone()
        at = stop
    return Run(tokens=tokens, logits=torch.cat(parts), states=states)


def _same_rows(a: CacheState, b: CacheState) -> bool:
    """Whether two states hold the same bytes (window, compressed, indexer rows) and tail."""
    if a.length != b.length or len(a.window_rows) != len(b.window_rows):
        return False
    if not all(torch.equal(x, y) for x, y in zip(a.window_rows, b.window_rows, strict=True)):
        return False
    for s in a.kv_rows:
        if not (torch.equal(a.kv_rows[s], b.kv_rows[s]) and torch.equal(a.index_rows[s], b.index_rows[s])):
            return False
    if (a.tail is None) != (b.tail is None):
        return False
    return a.tail is None or b.tail is None or torch.equal(a.tail, b.tail)


@pytest.fixture(scope="session")
def same_rows() -> Callable[[CacheState, CacheState], bool]:
    """`same_rows(a, b)`: whether two states hold the same bytes and tail."""
    return _same_rows


@pytest.fixture(scope="session")
def make_tokens() -> Callable[..., list[int]]:
    """`make_tokens(n, seed=1)`: seeded token ids."""
    return _make_tokens
