"""The leased round's nodes: the fewest whose copies cover every run (docs/FLEET.md F82).

A leased Lookup asks each run of one replica (F32), one call per node naming all of that node's runs (F50).
Asking each run of the first replica of its read order (F33) spreads the runs over as many nodes as there are
first readers: at replication 2 that is every node, whatever the count, where fewer would hold every run. Each
call costs the client a call's CPU under the GIL (about 0.13 ms here) and the round waits for the slowest node, so
the round asks the fewest nodes instead, chosen greedily: the node holding the most runs not yet covered, ties
to the node read first by the most of them (this client's draw, so clients still spread), then to the one whose
name comes first in the runs' read orders. A run is only given to a replica ranked with its first reader (F33's
classes: a replica on this host before the others, a node that just failed last), so the draw is the only freedom
taken: a run whose first reader is this host's is asked here, and a suspect is asked only where every copy is.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence

from kvstore.client.fleet_nodes import NodePool
from kvstore.fleet.placement import RunPlacement

#: Covers a pool made, by (copies a run, the runs' keys): a prompt asked again under the same view snapshot,
#: suspects and host name is covered as before without its read orders (64 runs at r=2: ~5 us, not 45-75).
_MADE: weakref.WeakKeyDictionary[NodePool, dict[tuple[int, tuple[bytes, ...]], tuple[
    Mapping[str, object], frozenset[str], str, list[tuple[int, str]]]]] = weakref.WeakKeyDictionary()
#: Covers a pool remembers (then forgets them all and makes them again: a bound, not a policy).
MAX_COVERS = 1024


def cover_runs(pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes]) -> list[tuple[int, str]]:
    """(run index, node) for every run of `chain`: the node the leased round asks it of (see the module's
    docstring).

    Returns:
        One pair per run, in run order; a list this module may hand out again, not to be changed.
    """
    if all(len(run.replicas) == 1 for run in runs):
        return [(i, run.replicas[0]) for i, run in enumerate(runs)]  # no choice: r=1, or one live node
    nodes = pool.view.nodes
    suspects = frozenset(n for n in nodes if pool.suspect(n))
    key = (max(len(run.replicas) for run in runs), tuple(chain[run.first_block] for run in runs))
    made = _MADE.setdefault(pool, {})
    known = made.get(key)
    if known is not None and known[0] is nodes and known[1] == suspects and known[2] == pool.hostname:
        return known[3]
    asks = _cover(pool, runs, lambda i: pool.read_order(chain[runs[i].first_block], runs[i].replicas))
    if len(made) >= MAX_COVERS:
        made.clear()
    made[key] = (nodes, suspects, pool.hostname, asks)
    return asks


def _cover(pool: NodePool, runs: Sequence[RunPlacement], orders: Callable[[int], list[str]]) -> list[
        tuple[int, str]]:
    """The greedy cover of `runs` by their replicas ranked with each one's first reader in `orders`."""
    chosen: list[str | None] = [run.replicas[0] if len(run.replicas) == 1 else None for run in runs]
    choices = _choices(pool, runs, orders, chosen)
    holders: dict[str, set[int]] = {}  # insertion order: the runs' read orders, first to last
    first: dict[str, set[int]] = {}
    for i, nodes in choices.items():
        for node in nodes:
            holders.setdefault(node, set()).add(i)
            first.setdefault(node, set())
        first[nodes[0]].add(i)
    left = set(choices)
    while left:
        node = max(holders, key=lambda n: (len(holders[n] & left), len(first[n] & left)))
        got = holders.pop(node) & left
        for i in got:
            chosen[i] = node
        left -= got
    return [(i, node) for i, node in enumerate(chosen) if node is not None]


def _choices(pool: NodePool, runs: Sequence[RunPlacement], orders: Callable[[int], list[str]],
             chosen: list[str | None]) -> dict[int, list[str]]:
    """Each run of several copies: its replicas ranked with its first reader, in its read order; a run with one
    such replica is chosen at once (in `chosen`)."""
    rank: dict[str, tuple[bool, bool]] = {}
    nodes = pool.view.nodes

    def rank_of(node: str) -> tuple[bool, bool]:
        found = rank.get(node)
        if found is None:
            record = nodes.get(node)
            found = rank[node] = (pool.suspect(node), record is None or record.host != pool.hostname)
        return found

    choices: dict[int, list[str]] = {}
    for i, run in enumerate(runs):
        if chosen[i] is not None:
            continue
        order = orders(i)
        top = rank_of(order[0])
        same = [n for n in order if n in run.replicas and rank_of(n) == top]
        if len(same) == 1:
            chosen[i] = same[0]
        else:
            choices[i] = same
    return choices
