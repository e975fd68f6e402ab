"""Rendezvous placement of runs (docs/FLEET.md F9-F13): pure functions, checked over many runs and fleets."""

from __future__ import annotations

import hashlib
import math
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import prefix
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.fleet.placement import (
    Layout,
    nodes_touched,
    place_chain,
    replicas,
    run_count,
    run_key,
    score,
    scores,
)
from kvstore.geometry import V4_1_FLASH

#: Run keys the properties are measured over (each stands for a run's first block hash).
RUN_KEYS = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(2000)]


def node_ids(n: int, seed: int = 0) -> list[str]:
    """`n` node ids shaped like the store ids of tiers.datadir (uuid4 hex), reproducible from `seed`."""
    return [uuid.UUID(bytes=hashlib.md5(f"{seed}/{i}".encode()).digest(), version=4).hex for i in range(n)]


def tolerance(p: float, trials: int) -> float:
    """Six binomial standard deviations of a fraction `p` over `trials`, so a fair hash never fails it."""
    return 6 * math.sqrt(p * (1 - p) / trials) + 1e-9


def million_token_chain() -> list[bytes]:
    tokens = [(i * 7919) % 100_000 for i in range(1_000_000)]
    return prefix.chain_hashes(tokens, block_tokens=64, parent=prefix.root_hash(V4_1_FLASH.fingerprint, 64))


def test_f9_a_million_token_prompt_is_62_runs_on_a_bounded_set_of_nodes() -> None:
    chain = million_token_chain()
    assert len(chain) == 15_625 and run_count(len(chain), 256) == 62
    for fleet_size in (3, 60, 1000):
        placed = place_chain(chain, node_ids(fleet_size), run_blocks=256, replication=2)
        assert len(placed) == 62
        assert [p.first_block for p in placed] == [256 * r for r in range(62)]
        assert placed[-1].end_block == 15_625 and placed[-1].end_block - placed[-1].first_block == 9
        primaries = {p.replicas[0] for p in placed}
        # One node per run at most, whatever the fleet's size: a 1,000-node fleet is asked by 62, not 1,000.
        assert len(primaries) <= min(62, fleet_size)
        assert len(nodes_touched(placed)) <= min(2 * 62, fleet_size)
    # Placed per block, the first 1,000 blocks alone would ask nearly every node of a 60-node fleet.
    per_block = {replicas(h, node_ids(60), 1)[0] for h in chain[:1000]}
    assert len(per_block) == 60


def test_f10_placement_is_a_function_of_the_run_and_the_id_set() -> None:
    ids = node_ids(20)
    key = RUN_KEYS[0]
    assert replicas(key, ids, 3) == replicas(key, list(reversed(ids)), 3) == replicas(key, set(ids), 3)
    assert score(key, ids[0]) == score(key, ids[0])
    # Pinned: a change of the scoring rule changes every fleet's placement, so it needs a new SCORE_TAG.
    assert score(b"\x00" * 32, "node-a") == int.from_bytes(
        hashlib.blake2b(b"kvstore.fleet.placement.v1\0" + (32).to_bytes(4, "little") + b"\x00" * 32 + b"node-a",
                        digest_size=8).digest(), "big")


def test_f10_every_block_of_a_run_shares_its_placement() -> None:
    chain = [hashlib.sha256(bytes([i])).digest() for i in range(10)]
    placed = place_chain(chain, node_ids(8), run_blocks=4, replication=2)
    assert [(p.first_block, p.end_block) for p in placed] == [(0, 4), (4, 8), (8, 10)]
    for p in placed:
        assert p.replicas == replicas(run_key(chain, p.run, 4), node_ids(8), 2) == replicas(chain[p.first_block],
                                                                                           node_ids(8), 2)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(min_value=1, max_value=40), k=st.integers(min_value=1, max_value=3),
       seed=st.integers(min_value=0, max_value=2**32))
def test_f11_adding_a_node_moves_about_one_in_n_plus_one_of_the_copies(n: int, k: int, seed: int) -> None:
    before_ids = node_ids(n, seed)
    added = node_ids(1, seed + 1)[0]
    after_ids = [*before_ids, added]
    moved_copies = moved_primaries = 0
    for key in RUN_KEYS:
        before, after = replicas(key, before_ids, k), replicas(key, after_ids, k)
        moved = set(after) - set(before)
        assert moved <= {added}  # only the new node gains copies: nothing moves between old nodes
        moved_copies += len(moved)
        moved_primaries += after[0] != before[0]
    # The new node wins a run's i-th place with probability 1/(N+1) for each i: about k/(N+1) of the runs
    # gain it, one copy each, out of k copies per run where there were at least k nodes.
    copies = len(RUN_KEYS) * min(k, n + 1)
    expected = min(k, n + 1) / (n + 1) * len(RUN_KEYS) / copies
    assert abs(moved_copies / copies - expected) <= tolerance(expected, len(RUN_KEYS))
    assert abs(moved_primaries / len(RUN_KEYS) - 1 / (n + 1)) <= tolerance(1 / (n + 1), len(RUN_KEYS))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(min_value=2, max_value=40), k=st.integers(min_value=1, max_value=3),
       seed=st.integers(min_value=0, max_value=2**32), which=st.integers(min_value=0))
def test_f12_removing_a_node_moves_only_the_copies_it_held(n: int, k: int, seed: int, which: int) -> None:
    ids = node_ids(n, seed)
    gone = ids[which % n]
    rest = [i for i in ids if i != gone]
    for key in RUN_KEYS[:500]:
        before, after = replicas(key, ids, k), replicas(key, rest, k)
        if gone not in before:
            assert after == before
        else:  # the survivors keep their order; the next-ranked node takes the lost place, at the end
            kept = tuple(i for i in before if i != gone)
            assert after[: len(kept)] == kept and len(after) == min(k, n - 1)


@given(n=st.integers(min_value=1, max_value=12), k=st.integers(min_value=1, max_value=5),
       key=st.binary(min_size=32, max_size=32))
def test_f13_replicas_are_distinct_nodes_as_many_as_there_can_be(n: int, k: int, key: bytes) -> None:
    ids = node_ids(n)
    chosen = replicas(key, ids, k)
    assert len(set(chosen)) == len(chosen) == min(k, n) and set(chosen) <= set(ids)
    assert chosen == tuple(sorted(ids, key=lambda i: (-score(key, i), i))[: min(k, n)])


def test_runs_spread_evenly_over_the_nodes() -> None:
    ids = node_ids(10)
    counts = dict.fromkeys(ids, 0)
    for key in RUN_KEYS:
        counts[replicas(key, ids, 1)[0]] += 1
    share = 1 / 10
    assert all(abs(c / len(RUN_KEYS) - share) <= tolerance(share, len(RUN_KEYS)) for c in counts.values())


def test_bad_arguments_are_named() -> None:
    with pytest.raises(Unavailable, match="no storage node"):
        replicas(RUN_KEYS[0], [], 1)
    with pytest.raises(InvalidArgument, match="replication factor"):
        replicas(RUN_KEYS[0], ["a"], 0)
    with pytest.raises(InvalidArgument, match="run 3 starts at block 12"):
        run_key([b"x"] * 10, 3, 4)
    with pytest.raises(InvalidArgument):
        run_count(10, 0)
    with pytest.raises(InvalidArgument):
        Layout(run_blocks=0, block_tokens=64)
    assert place_chain([], ["a"], run_blocks=256, replication=2) == ()


def test_layouts_round_trip_and_name_their_run_tokens() -> None:
    layout = Layout(run_blocks=256, block_tokens=64)
    assert layout.run_tokens == 16_384 and Layout.from_json(layout.to_json()) == layout
    assert Layout.from_json(b"{") is None and Layout.from_json(b'{"run_blocks": 0, "block_tokens": 64}') is None


def test_f65_a_chain_placed_again_is_placed_from_the_memo_exactly_as_cold() -> None:
    """F65: a prompt sent again is placed by its runs' keys from a memo; what it gives is the cold placement."""
    import kvstore.fleet.placement as placement

    chain = [bytes([i % 251, i // 251]) * 16 for i in range(1000)]
    nodes = ["n1", "n2", "n3"]
    first = placement.place_chain(chain, nodes, run_blocks=64, replication=2)
    assert placement.place_chain(list(chain), nodes, run_blocks=64, replication=2) is first
    placement._placed.cache_clear()
    placement.ranked.cache_clear()
    assert placement.place_chain(chain, nodes, run_blocks=64, replication=2) == first
    assert [r.end_block for r in first][-2:] == [960, 1000] and first[-1].first_block == 960
    assert placement.place_chain(chain, nodes[:2], run_blocks=64, replication=2) != first  # another node set
    assert placement.place_chain(chain[:999], nodes, run_blocks=64, replication=2)[-1].end_block == 999


@settings(max_examples=50, deadline=None)
@given(key=st.binary(min_size=0, max_size=64), ids=st.lists(st.text(min_size=1, max_size=40), max_size=12, unique=True))
def test_scores_of_many_nodes_are_each_node_s_score(key: bytes, ids: list[str]) -> None:
    """`scores` (the key hashed once, copied per node) gives exactly `score` of each node: placement is unchanged."""
    assert scores(key, ids) == {n: score(key, n) for n in ids}
