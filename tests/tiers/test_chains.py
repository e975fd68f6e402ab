"""R15 with the memo of verified chains (tiers/chains.py): a chain already seen is found by
binary search, and the memo never vouches for hashes that are not that chain."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tiers import chains
from tiers.chains import ChainCache, ChainIndex, PackedHashes

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


def test_packed_hashes_read_as_the_list_of_their_hashes() -> None:
    rng = random.Random(25)
    for n in (0, 1, 2, 7, 33):
        hashes = [rng.randbytes(32) for _ in range(n)]
        packed = PackedHashes(b"".join(hashes))
        assert len(packed) == n and list(packed) == hashes and packed == hashes and packed == tuple(hashes)
        for i in range(-n, n):
            assert packed[i] == hashes[i]
        for i in (n, -n - 1):
            with pytest.raises(IndexError):
                packed[i]
        for _ in range(40):
            a, b, step = rng.randint(-n - 2, n + 2), rng.randint(-n - 2, n + 2), rng.choice((1, 1, 2, -1))
            part = packed[a:b:step]
            assert isinstance(part, PackedHashes) and list(part) == hashes[a:b:step]
        assert packed[:] is packed  # the whole: no copy
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedHashes(b"x" * 33)


def test_r15_packed_hashes_find_what_the_walk_finds(make_kit: Any) -> None:
    """Fuzz: the memo's path (packed or a list) against the record-by-record walk, over prompts made
    of stored chains, cut, extended, repeated, swapped and mixed, as the memo learns and forgets."""
    kit = make_kit(blocks=64)
    rng = random.Random(15)
    a, b = kit.chain(0, 12), kit.chain(50_000, 6)
    kit.put(a, 0, 5)
    kit.put(a, 5, 9)  # a link: the chain ending at a[8] is the one ending at a[4], then a[5:9]
    kit.put(b)
    stray = kit.chain(90_000, 3)

    def prompts() -> list[list[bytes]]:
        base = rng.choice((a, b, a[:9], b[:4]))
        cut = base[:rng.randint(1, len(base))]
        out = [cut, [*cut, *stray[:rng.randint(1, 3)]], [*cut, cut[-1]], cut[1:] or cut]
        if len(cut) > 2:
            i = rng.randrange(len(cut) - 1)
            out.append([*cut[:i], cut[i + 1], cut[i], *cut[i + 2:]])
            out.append([*cut[:i], stray[0], *cut[i + 1:]])
        out.append([*a[:rng.randint(1, 9)], *b[:rng.randint(1, 6)]])
        return out

    for round_ in range(60):
        if round_ % 20 == 10:
            kit.tier.chains.forget()
        for hashes in prompts():
            want = kit.tier.chains._walk(kit.scope, hashes)[0]
            assert kit.found(PackedHashes(b"".join(hashes))) == want, hashes
            assert kit.found(hashes) == want, hashes


def test_r15_a_chain_put_in_many_batches_is_known_through_its_links_then_kept_whole(
        make_kit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    kit = make_kit(blocks=64)
    a = kit.chain(0, 2 * (chains.MAX_LINKS + 2))
    for start in range(0, len(a), 2):  # one link per Put
        kit.put(a, start, start + 2)
    no_walk(monkeypatch)
    memo = kit.tier.chains.memo
    assert kit.found(PackedHashes(b"".join(a))) == len(a)  # followed every link
    tail = memo._tails[kit.scope.key(a[-1])]
    assert (tail.parent, tail.piece) == (None, b"".join(a))  # kept as one piece now
    assert kit.found(a[:6]) == 6  # a link's own chain (a Put ended there), through its links


def test_r15_a_forgotten_or_contradicted_link_is_not_vouched_for() -> None:
    h = [bytes([i]) * 32 for i in range(6)]
    memo = ChainCache()
    memo.remember(b"k1", h[:2])
    memo.extend(b"k1", b"k3", h[2:4])
    memo.extend(b"k3", b"k5", h[4:6])
    assert memo.knows(b"k5", h) and memo.knows(b"k3", h[:4])
    assert not memo.knows(b"k5", [*h[:3], h[2], *h[4:]])  # a hash of the middle link differs
    assert not memo.knows(b"k5", [h[1], h[0], *h[2:]])  # the root piece differs
    assert not memo.knows(b"k5", h[:5]) and not memo.knows(b"k5", [*h, h[5]])  # another depth
    memo.extend(b"nowhere", b"k9", h[2:4])  # the parent is not known: nothing is recorded
    assert len(memo) == 3
    memo.remember(b"k1", h[:1])  # a first link of another depth: the chain through it is not known
    assert not memo.knows(b"k5", h)
    memo.remember(b"k1", h[:2])
    assert memo.knows(b"k5", h)
    memo._put(b"k3", chains._Tail(5, b"k1", b"".join(h[2:4])))  # a link that says another depth
    assert not memo.knows(b"k5", h)
    memo._put(b"k3", chains._Tail(4, None, b"".join(h[2:4])))  # a first piece that does not start at block 0
    assert not memo.knows(b"k3", h[:4]) and not memo.knows(b"k5", h)
    memo.extend(b"k1", b"k3", h[2:4])
    memo._tails.pop(b"k3")  # a link forgotten: the chains through it are walked again
    assert not memo.knows(b"k5", h)


def test_the_memo_keeps_at_most_its_bytes() -> None:
    memo = ChainCache(max_bytes=3 * (64 + chains.ENTRY_OVERHEAD_BYTES))
    pieces = {bytes([k]) * 48: [bytes([k]) * 32, bytes([k + 1]) * 32] for k in range(1, 9, 2)}
    for key, hashes in pieces.items():
        memo.remember(key, hashes)
    assert len(memo) == 3 and memo.size_bytes <= memo.max_bytes
    first, *rest = pieces
    assert not memo.knows(first, pieces[first]) and all(memo.knows(k, pieces[k]) for k in rest)
    memo.remember(b"big", [b"x" * 32] * 20)  # larger than the whole memo: not kept, nothing dropped
    assert len(memo) == 3 and not memo.knows(b"big", [b"x" * 32] * 20)


def test_a5_a_next_turn_from_its_anchor_finds_what_the_walk_finds(make_kit: Any) -> None:
    """Fuzz: `find_after` (the anchor's record, then the hashes after it) against the record-by-record walk
    of the whole prompt, for every anchor the walk would vouch for; an anchor not stored at its depth
    (another depth, a stray hash, a block the prompt does not reach) is None, never a count."""
    kit = make_kit(blocks=64)
    rng = random.Random(25)
    a, b = kit.chain(0, 12), kit.chain(50_000, 6)
    kit.put(a, 0, 9)
    kit.put(b)
    stray = kit.chain(90_000, 3)
    for _ in range(300):
        base = rng.choice((a, b))
        cut = base[:rng.randint(1, len(base))]
        tail = rng.choice(([], stray[:rng.randint(1, 3)], [cut[-1]], b[:rng.randint(1, 6)], a[rng.randint(0, 11):]))
        hashes = [*cut, *tail]
        if len(hashes) > 2 and rng.random() < 0.3:
            i = rng.randrange(1, len(hashes) - 1)
            hashes[i], hashes[i + 1] = hashes[i + 1], hashes[i]
        want = kit.tier.chains._walk(kit.scope, hashes)[0]
        depth = rng.randint(1, len(hashes))
        got = kit.tier.chains.find_after(kit.scope, hashes[depth - 1], depth, PackedHashes(b"".join(hashes[depth:])))
        if depth <= want:
            assert got is not None and got[0] == want, (hashes, depth)
        # Whatever the hashes above it: the anchor stands for the stored chain ending at it, when one does.
        truth = next((c[:depth] for c in (a[:9], b) if len(c) >= depth and c[depth - 1] == hashes[depth - 1]), None)
        if truth is None:
            assert got is None, (hashes, depth)
        else:
            assert got is not None and got[0] == kit.tier.chains._walk(kit.scope, [*truth, *hashes[depth:]])[0]
        lease = kit.tier.lookup_after(kit.scope, hashes[depth - 1], depth, hashes[depth:], 1.0)
        assert (lease is None) == (got is None)


class _CountingEnv:
    """The tier's real LMDB environment, counting the read txns begun on it and the records they read."""

    def __init__(self, env: Any) -> None:
        self.env, self.txns, self.gets = env, 0, 0

    def begin(self, **kwargs: Any) -> Any:
        self.txns += 1
        counter, txn = self, self.env.begin(**kwargs)

        class Txn:
            def __enter__(self) -> Txn:
                txn.__enter__()
                return self

            def __exit__(self, *exc: Any) -> Any:
                return txn.__exit__(*exc)

            def get(self, *args: Any) -> Any:
                counter.gets += 1
                return txn.get(*args)

        return Txn()


def test_f75_runs_found_in_one_txn_are_each_runs_own_find(make_kit: Any) -> None:
    """F75 (docs/FLEET.md): `find_runs` answers each run as its own `find` does (R15 within the run), over runs
    stored, cut, absent, not a chain and mixed, as the memo learns and forgets."""
    kit = make_kit(blocks=200)
    rng = random.Random(79)
    runs = [kit.chain(i * 10_000, 8) for i in range(6)]
    for i, run in enumerate(runs):
        kit.put(run, 0, 8 - i % 3)  # some runs stored whole, some cut
    stray = kit.chain(90_000, 4)

    def one_run() -> list[bytes]:
        run = rng.choice(runs)
        return rng.choice([run, run[:rng.randint(1, 8)], stray, [*run[:3], stray[0], *run[4:]], run[1:], [run[0]]])

    index = kit.tier.chains
    for round_ in range(40):
        if round_ % 10 == 5:
            index.forget()
        asked = [one_run() for _ in range(rng.randint(1, 6))]
        want = [index._walk(kit.scope, run)[0] for run in asked]
        got = index.find_runs(kit.scope, PackedHashes(b"".join(b"".join(r) for r in asked)), [len(r) for r in asked])
        assert [found for found, _ in got] == want, asked
        assert got == [index.find(kit.scope, run) for run in asked]


def test_f75_a_call_of_known_runs_reads_one_record_each_in_one_txn(make_kit: Any) -> None:
    """F75: runs the memo knows are read in one read txn, a stored run by its last block alone, an absent one by
    its last and first; the walk then reads the absent one's first block and the next (R16)."""
    kit = make_kit(blocks=200)
    runs = [kit.chain(i * 10_000, 16) for i in range(8)]
    for run in runs:
        kit.put(run)
    index = kit.tier.chains
    counting = _CountingEnv(index._env)
    index._env = counting
    stored = index.find_runs(kit.scope, PackedHashes(b"".join(b"".join(r) for r in runs)), [16] * 8)
    assert [found for found, _ in stored] == [16] * 8
    assert (counting.txns, counting.gets) == (1, 8)
    counting.txns = counting.gets = 0
    absent = kit.chain(99_000, 16)
    index.find_runs(kit.scope, PackedHashes(b"".join([*runs[0], *absent])), [16, 16])
    assert (counting.txns, counting.gets) == (1, 1 + 2 + 2)


def test_f75_lookup_runs_leases_each_found_run_once_together(kit: Kit) -> None:
    """F75: `lookup_runs` leases each run's deepest found block (none for a run not found), as a Lookup per run."""
    runs = [kit.chain(i * 10_000, 3) for i in range(3)]
    kit.put(runs[0])
    kit.put(runs[2], 0, 2)
    hashes = PackedHashes(b"".join(b"".join(r) for r in runs))
    answers = kit.tier.lookup_runs(kit.scope, hashes, [3, 3, 3], 60.0)
    assert [found for found, _ in answers] == [3, 0, 2]
    assert [lease.key if lease else None for _, lease in answers] == [kit.scope.key(runs[0][2]), None,
                                                                      kit.scope.key(runs[2][1])]
    assert kit.tier.leases.pinned() == {kit.scope.key(runs[0][2]), kit.scope.key(runs[2][1])}
    assert all(kit.tier.release(lease.lease_id) for _, lease in answers if lease)
    assert kit.tier.leases.active() == 0
