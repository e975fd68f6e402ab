"""R15 with the memo of verified chains (tiers/chains.py): a chain already seen is found by
binary search, and the memo never vouches for hashes that are not that chain."""

from __future__ import annotations

from typing import Any

import pytest

from tiers.chains import ChainCache, ChainIndex

Kit = Any  # tests/tiers/conftest.py


def no_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the record-by-record walk fail: what is found next comes from the memo."""
    def walk(*args: object) -> None:
        raise AssertionError("walked the chain")

    monkeypatch.setattr(ChainIndex, "_walk", walk)


def test_r15_a_chain_looked_up_once_is_found_again_without_a_walk(kit: Kit,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a = kit.chain(0, 6)
    kit.put(a, 0, 3)
    kit.tier.chains.forget()  # forget what the Put taught it
    assert kit.found(a) == 3  # walks, then remembers
    no_walk(monkeypatch)
    assert kit.found(a) == 3
    assert kit.found(a[:3]) == 3


def test_r15_a_put_extending_a_known_chain_makes_the_longer_one_known(kit: Kit,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    a = kit.chain(0, 8)
    kit.put(a, 0, 3)
    kit.put(a, 3, 8)  # extends the remembered chain ending at a[2]
    no_walk(monkeypatch)
    assert kit.found(a) == 8


def test_r15_the_memo_never_vouches_for_hashes_that_are_not_its_chain(kit: Kit) -> None:
    a = kit.chain(0, 4)
    kit.put(a)
    assert kit.found(a) == 4  # known now
    other = kit.chain(9000, 1)[0]
    cases = {
        "absent first, then stored": ([other, *a[1:]], 0),
        "one hash repeated at the end": ([*a[:3], a[2]], 3),
        "not from the chain's start": (a[1:], 0),
        "the first two swapped": ([a[1], a[0], *a[2:]], 0),
        "the chain": (a, 4),
    }
    for name, (hashes, want) in cases.items():
        assert kit.found(hashes) == want, name


def test_r15_a_known_chain_whose_tail_was_evicted_is_found_shorter(kit: Kit) -> None:
    a = kit.chain(0, 5)
    kit.put(a)
    assert kit.found(a) == 5
    kit.tier.drop_corrupt([kit.scope.key(a[3])])  # removes a[3] and a[4]: the tail goes, as eviction does
    assert kit.found(a) == 3
    assert kit.stored(a) == [True, True, True, False, False]


def test_the_memo_forgets_the_least_recently_used_chains() -> None:
    memo = ChainCache(capacity=2)
    chains = {bytes([k]) * 48: [bytes([k]) * 32, bytes([k + 1]) * 32] for k in (1, 3, 5)}
    for key, hashes in chains.items():
        memo.remember(key, hashes)
    first, second, third = chains
    assert not memo.knows(first, chains[first])
    assert memo.knows(second, chains[second]) and memo.knows(third, chains[third])
    assert not memo.knows(third, chains[second]) and not memo.knows(third, chains[third][:1])
