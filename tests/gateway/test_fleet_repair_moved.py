"""A pass after a membership change plans only the runs it moved (gateway/fleet_repair.py, docs/FLEET.md F18f): the
runs whose replicas, or the nodes ranked above this one, are not those of the last settled pass. A real etcd, three
in-process nodes on loopback (real LMDB, real gRPC)."""

from __future__ import annotations

from typing import Any

from gateway.fleet_repair import FleetRepairer
from kvstore.fleet.placement import replicas
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import SCOPE, chain, put
from tiers import run_index

RUNS = 40


def _runs_on_a(fleet: Fleet) -> tuple[Any, list[tuple[list[bytes], list[bytes]]]]:
    """Nodes a and b, a holding RUNS one-block runs: (the view, the runs)."""
    tiers, _, view = fleet.start(["a", "b"])
    runs = [chain(1, seed=700 + i) for i in range(RUNS)]
    for hashes, blocks in runs:
        put(tiers["a"], hashes, blocks)
    return view, runs


def _asked_roots(r: FleetRepairer) -> set[bytes]:
    """Every run root `r`'s RunDigests ask about from now on (the set, filled as they are asked)."""
    asked: set[bytes] = set()
    ask = r._ask

    async def watched(peer: str, address: str, method: str, request: Any) -> Any:
        if method == "RunDigests":
            asked.update(request.run_roots)
        return await ask(peer, address, method, request)

    r._ask = watched  # type: ignore[method-assign]
    return asked


def _moved(roots: list[bytes], before: list[str], after: list[str]) -> set[bytes]:
    """The roots (of runs on a, replication 2) whose replicas or nodes ranked above a differ between the views."""
    def asked(key: bytes, nodes: list[str]) -> tuple[str, ...]:
        order = replicas(key[-32:], nodes, len(nodes))
        return order[:max(order.index("a") + 1, min(2, len(order)))]

    return {k for k in roots if asked(k, before) != asked(k, after)}


def _join_c(fleet: Fleet, view: Any) -> None:
    fleet.node("c")
    fleet.loop.run(view.wait_until(lambda m: set(m.nodes) == {"a", "b", "c"}, 10))


def test_f18f_a_pass_after_a_join_asks_only_about_the_runs_whose_nodes_moved(fleet: Fleet) -> None:
    """A settled pass over {a, b} (every run copied to b), then c joins: a's next pass asks about the runs whose
    replicas or nodes ranked above a moved, and no other; after a's and b's passes each run is on its replicas."""
    view, runs = _runs_on_a(fleet)
    r = fleet.repairer("a", view)
    assert fleet.one_pass(r).failed_runs == 0
    _join_c(fleet, view)
    roots = [e.key for e in run_index.list_runs(fleet.nodes["a"].tier.env)]
    moved = _moved(roots, ["a", "b"], ["a", "b", "c"])
    assert 0 < len(moved) < len(roots)  # the seeds place some runs on c, not all
    asked = _asked_roots(r)
    progress = fleet.one_pass(r)
    assert asked == moved
    assert (progress.under_replicated_bytes, progress.failed_runs) == (0, 0)
    fleet.one_pass(fleet.repairer("b", view))  # where b ranks above a, b sends c its copy
    for hashes, blocks in runs:
        for node in replicas(hashes[0], ["a", "b", "c"], 2):
            assert [data for _, data in fleet.nodes[node].tier.read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18f_a_pass_that_failed_a_run_is_not_settled_so_the_next_plans_every_run(fleet: Fleet) -> None:
    """b is down during a's first pass (its runs undecided: failed); b comes back and c joins: a's next pass asks
    about every run, not only the moved ones."""
    view, _ = _runs_on_a(fleet)
    b = fleet.nodes["b"]
    fleet.loop.run(b.halt())
    r = fleet.repairer("a", view)
    assert fleet.one_pass(r).failed_runs > 0
    fleet.loop.run(b.serve())
    _join_c(fleet, view)
    roots = [e.key for e in run_index.list_runs(fleet.nodes["a"].tier.env)]
    asked = _asked_roots(r)
    progress = fleet.one_pass(r)
    assert asked == set(roots)
    assert (progress.under_replicated_bytes, progress.failed_runs) == (0, 0)


def test_f18f_moved_since_agrees_with_the_placement_s_ranking_over_both_views() -> None:
    """`_moved_since`'s scores hashed once for both views give the runs that `placement.replicas`' rankings of the
    old and the new nodes do (nodes left, joined, or both; replication 1 to 3)."""
    import hashlib
    from types import SimpleNamespace

    from tiers.run_index import RunEntry

    entries = [RunEntry(key=b"\0" * 8 + hashlib.sha256(bytes([i])).digest(), first_block=0) for i in range(200)]
    for copies in (1, 2, 3):
        me = SimpleNamespace(node_id="a", copies_of=lambda _e, c=copies: c)
        for before, after in ((["a", "b", "c"], ["a", "b"]), (["a", "b"], ["a", "b", "c"]),
                              (["a", "b", "c", "d"], ["a", "c", "e"]), (["a", "b"], ["a"])):
            def asked(key: bytes, nodes: list[str], c: int = copies) -> tuple[str, ...]:
                order = replicas(key, nodes, len(nodes))
                return order[:max(order.index("a") + 1, min(c, len(order)))]

            want = [e for e in entries if asked(e.run_key, before) != asked(e.run_key, after)]
            assert FleetRepairer._moved_since(me, entries, before, after) == want  # type: ignore[arg-type]
