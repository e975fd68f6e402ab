"""The fleet client's chains through the chain memo (kvstore.client.fleet_chain.FleetChainMemo, docs/FLEET.md F56):
a conversation's next turn hashes only its new blocks, and every answer equals the cold `fleet_hashes`."""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore.client.chain_memo as chain_memo_module
from kvstore.client.fleet_chain import FleetChainMemo, fleet_hashes
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH
from kvstore.prefix import chain_hashes_of_bytes, root_hash

BT = 4  # tokens per block: small, so a prompt of a few thousand tokens spans many runs
RUN_BLOCKS = 32
RUN_TOKENS = BT * RUN_BLOCKS
ROOT = root_hash(V4_1_FLASH.fingerprint, BT)
OTHER_ROOT = root_hash(TINY.fingerprint, BT)


def cold(tokens: Sequence[int], root: bytes = ROOT, extra_keys: Sequence[Any] = ()) -> list[bytes]:
    return fleet_hashes(list(tokens), root=root, block_tokens=BT, run_blocks=RUN_BLOCKS, extra_keys=extra_keys)


def memo(**kwargs: Any) -> FleetChainMemo:
    return FleetChainMemo(block_tokens=BT, run_blocks=RUN_BLOCKS, **kwargs)


@pytest.fixture
def hashed_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Blocks the chain memo hashes, call by call: a spy on the one function it hashes with."""
    calls: list[int] = []

    def spy(raw: Any, **kwargs: Any) -> list[bytes]:
        out = chain_hashes_of_bytes(raw, **kwargs)
        calls.append(len(out))
        return out

    monkeypatch.setattr(chain_memo_module, "chain_hashes_of_bytes", spy)
    yield calls


def test_f56_a_next_turn_hashes_only_its_new_blocks_through_the_chain_memo(hashed_blocks: list[int]) -> None:
    """Turn 1 spans 5 runs and 20 blocks of a sixth; turn 2 adds 30 blocks (the sixth run completed, a seventh
    begun): only those 30 are hashed, each full run answered by its memo, and the hashes equal the cold path's."""
    m = memo()
    turn1 = [random.randrange(1 << 17) for _ in range(5 * RUN_TOKENS + 20 * BT + 3)]
    assert m.hashes(turn1, root=ROOT) == cold(turn1)
    assert sum(hashed_blocks) == 5 * RUN_BLOCKS + 20
    hashed_blocks.clear()
    turn2 = turn1[:-3] + [random.randrange(1 << 17) for _ in range(30 * BT)]
    assert m.hashes(turn2, root=ROOT) == cold(turn2)
    assert sum(hashed_blocks) == 30
    stats = [s.stats() for s in m.memos()]
    assert [s.hits for s in stats] == [1] * 6 + [0]  # runs 0-5 reused (run 5 from its 20 kept blocks)
    assert sum(s.reused_blocks for s in stats) == 5 * RUN_BLOCKS + 20
    hashed_blocks.clear()
    assert m.hashes(turn2, root=ROOT) == cold(turn2)  # the same prompt again: nothing hashed
    assert sum(hashed_blocks) == 0


@pytest.mark.parametrize("where", [0, RUN_TOKENS - 1, RUN_TOKENS, 3 * RUN_TOKENS + 7])
def test_f56_a_changed_token_rehashes_its_run_and_every_run_after(where: int, hashed_blocks: list[int]) -> None:
    """C1 per run, and the bridge: a token changed in run r changes run r's hashes and, through the bridge
    key, every later run's, though their tokens are the ones kept."""
    m = memo()
    kept = [random.randrange(1 << 17) for _ in range(5 * RUN_TOKENS)]
    m.hashes(kept, root=ROOT)
    hashed_blocks.clear()
    other = list(kept)
    other[where] += 1
    got = m.hashes(other, root=ROOT)
    assert got == cold(other)
    changed_run = where // RUN_TOKENS
    assert got[:changed_run * RUN_BLOCKS] == cold(kept)[:changed_run * RUN_BLOCKS]
    assert sum(hashed_blocks) == (5 - changed_run) * RUN_BLOCKS


def test_f56_other_extra_keys_or_root_never_reuse_a_run() -> None:
    m = memo()
    tokens = [random.randrange(1 << 17) for _ in range(3 * RUN_TOKENS)]
    m.hashes(tokens, root=ROOT, extra_keys=["adapter-a"])
    assert m.hashes(tokens, root=ROOT, extra_keys=["adapter-b"]) == cold(tokens, extra_keys=["adapter-b"])
    assert m.hashes(tokens, root=OTHER_ROOT) == cold(tokens, root=OTHER_ROOT)
    assert sum(s.stats().hits for s in m.memos()) == 0


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_f56_every_answer_equals_the_cold_fleet_hashes(data: st.DataObject) -> None:
    """C3 over a fleet: conversations that grow, branch and change keys, in any order, with a memo small enough
    to forget runs: every answer is `fleet_hashes`' exactly."""
    m = memo(max_bytes=data.draw(st.sampled_from([0, 6_000, 40_000, 1 << 20])), max_entries=3)
    prompts: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 8))):
        if prompts and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(prompts))
            cut = data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + data.draw(st.lists(st.integers(0, 7), max_size=3 * RUN_TOKENS))
        else:
            tokens = data.draw(st.lists(st.integers(0, 7), max_size=5 * RUN_TOKENS))
        prompts.append(tokens)
        keys = data.draw(st.sampled_from([(), ("a",), (b"\x00" * 32, "b")]))
        assert m.hashes(tokens, root=ROOT, extra_keys=keys) == cold(tokens, extra_keys=keys)


def test_f56_memory_is_bounded_over_every_run_and_the_deepest_runs_go_first() -> None:
    """C4 over the runs: the bytes kept over every run index stay under max_bytes; past it the deepest runs are
    forgotten (run r is reused only by prompts reaching it), so run 0 stays."""
    one_run = RUN_TOKENS * 4 + RUN_BLOCKS * 32 + 256  # a kept run: its token bytes, hashes and overhead
    m = memo(max_bytes=3 * one_run)
    tokens = [random.randrange(1 << 17) for _ in range(6 * RUN_TOKENS)]
    assert m.hashes(tokens, root=ROOT) == cold(tokens)
    kept = [s.stats().size_bytes for s in m.memos()]
    assert len(kept) == 3 and sum(kept) <= m.max_bytes
    assert m.hashes(tokens, root=ROOT) == cold(tokens)
    assert [s.stats().hits for s in m.memos()] == [1, 1, 1]
    none = memo(max_bytes=0)
    assert none.hashes(tokens, root=ROOT) == cold(tokens) and none.memos() == []


@pytest.mark.parametrize("form", [list, lambda t: array("I", t), lambda t: np.array(t, dtype=np.int64),
                                  lambda t: np.array(t, dtype="<u4")])
def test_f56_every_token_form_hashes_the_same(form: Any) -> None:
    tokens = [random.randrange(1 << 17) for _ in range(2 * RUN_TOKENS + 9)]
    assert memo().hashes(form(tokens), root=ROOT) == cold(tokens)


@pytest.mark.parametrize("bad", [[1, 2, 1 << 40], np.array([1, 2, -3], dtype=np.int64)])
def test_f56_bad_token_ids_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="token ids"):
        memo().hashes(bad, root=ROOT)
