"""A pass after a membership change plans only the runs it moved (gateway/fleet_repair.py, docs/FLEET.md F18f): the
runs whose replicas, or the nodes ranked above this one, are not those of the last settled pass. A real etcd, three
in-process nodes on loopback (real LMDB, real gRPC)."""

from __future__ import annotations

import asyncio
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
            assert FleetRepairer._moved_since(me, entries, [before], after) == want  # type: ignore[arg-type]


def test_f86_moved_since_over_given_up_views_is_the_union_of_each_view_s_moves() -> None:
    """F86: with the views of passes given up since the settled one, a run is moved where any of them (or the settled
    one) asks about it otherwise than the live view: the union of each pair's runs, and no other."""
    import hashlib
    from types import SimpleNamespace

    from tiers.run_index import RunEntry

    entries = [RunEntry(key=b"\0" * 8 + hashlib.sha256(bytes([i, 7])).digest(), first_block=0) for i in range(200)]
    me = SimpleNamespace(node_id="a", copies_of=lambda _e: 2)
    views = [["a", "b", "c"], ["a", "b", "c", "d"], ["a", "c", "d"]]
    live = ["a", "b", "c"]  # d came and went, b went and came back: the settled view again
    one_by_one = set()
    for view in views:
        one_by_one |= {e.key for e in FleetRepairer._moved_since(me, entries, [view], live)}  # type: ignore[arg-type]
    got = {e.key for e in FleetRepairer._moved_since(me, entries, views, live)}  # type: ignore[arg-type]
    assert got == one_by_one
    assert FleetRepairer._moved_since(me, entries, views[:1], live) == []  # type: ignore[arg-type]
    assert 0 < len(got) < len(entries)


def _given_up_pass(fleet: Fleet, r: FleetRepairer, view: Any, join: str = "", leave: str = "") -> None:
    """`r`'s pass over the view as it is, held at its first RunDigests until node `join` has joined (or `leave` has
    left: its lease revoked): given up."""
    import threading

    held, ask = threading.Event(), r._ask

    async def hold(peer: str, address: str, method: str, request: Any) -> Any:
        if method == "RunDigests" and not held.is_set():
            held.set()
            await asyncio.Event().wait()  # until the view moves: the pass is cancelled here
        return await ask(peer, address, method, request)

    r._ask = hold  # type: ignore[method-assign]
    running = asyncio.run_coroutine_threadsafe(r.pass_until_view_moves(), fleet.loop.loop)
    assert held.wait(30), "the pass never asked its first RunDigests"
    if join:
        fleet.node(join)
    else:
        registration = fleet.nodes[leave].registration
        assert registration is not None
        fleet.loop.run(registration.stop())
    running.result(timeout=60)
    r._ask = ask  # type: ignore[method-assign]


def test_f86_a_pass_given_up_is_resumed_asking_only_about_the_runs_some_view_since_the_settled_one_moved(
        fleet: Fleet) -> None:
    """A settled pass over {a, b}; c joins and a's pass over {a, b, c} is given up as d joins: a's next pass, over
    {a, b, c, d}, asks about the runs that {a, b} or {a, b, c} ask about otherwise than {a, b, c, d}, no other (not
    every run, as before F86); after the passes of every node each run is on its replicas."""
    view, runs = _runs_on_a(fleet)
    r = fleet.repairer("a", view)
    assert fleet.one_pass(r).failed_runs == 0
    _join_c(fleet, view)
    _given_up_pass(fleet, r, view, "d")
    assert r._given_up == [("a", "b", "c")] and r._settled == ("a", "b")
    fleet.loop.run(view.wait_until(lambda m: set(m.nodes) == {"a", "b", "c", "d"}, 10))
    roots = [e.key for e in run_index.list_runs(fleet.nodes["a"].tier.env)]
    now = ["a", "b", "c", "d"]
    want = _moved(roots, ["a", "b"], now) | _moved(roots, ["a", "b", "c"], now)
    assert 0 < len(want) < len(roots)
    asked = _asked_roots(r)
    progress = fleet.one_pass(r)
    assert asked == want
    assert (progress.under_replicated_bytes, progress.failed_runs) == (0, 0)
    assert r._given_up == [] and r._settled == tuple(now)  # settled again: the next change resumes from here
    for name in ("b", "c", "d"):
        fleet.one_pass(fleet.repairer(name, view))
    for hashes, blocks in runs:
        for node in replicas(hashes[0], now, 2):
            assert [data for _, data in fleet.nodes[node].tier.read([SCOPE.key(h) for h in hashes])] == blocks


def test_f86_a_pass_given_up_over_a_node_that_came_and_went_asks_about_the_runs_that_node_moved(
        fleet: Fleet) -> None:
    """A settled pass over {a, b}; c joins, and a's pass over {a, b, c} is given up as c leaves: the view is the
    settled one again, but under {a, b, c} b may have dropped its copy of a run c took as stale (F79), so a's next
    pass asks about the runs {a, b, c} moved, and only those."""
    view, _ = _runs_on_a(fleet)
    r = fleet.repairer("a", view)
    assert fleet.one_pass(r).failed_runs == 0
    _join_c(fleet, view)
    _given_up_pass(fleet, r, view, leave="c")
    fleet.loop.run(view.wait_until(lambda m: set(m.nodes) == {"a", "b"}, 10))
    roots = [e.key for e in run_index.list_runs(fleet.nodes["a"].tier.env)]
    want = _moved(roots, ["a", "b", "c"], ["a", "b"])
    assert 0 < len(want) < len(roots)
    asked = _asked_roots(r)
    assert fleet.one_pass(r).failed_runs == 0
    assert asked == want


def test_f86_past_resumed_views_given_up_in_a_row_the_next_pass_plans_every_run(fleet: Fleet) -> None:
    """RESUMED_VIEWS passes given up in a row keep their views; one more, and the next pass plans every run."""
    from gateway import fleet_repair

    view, _ = _runs_on_a(fleet)
    r = fleet.repairer("a", view)
    assert fleet.one_pass(r).failed_runs == 0
    for i in range(fleet_repair.RESUMED_VIEWS + 1):
        _given_up_pass(fleet, r, view, f"j{i}")
        assert len(r._given_up) == (i + 1 if i < fleet_repair.RESUMED_VIEWS else 0)
    fleet.loop.run(view.wait_until(lambda m: len(m.nodes) == 3 + fleet_repair.RESUMED_VIEWS, 10))
    held = {e.key for e in run_index.list_runs(fleet.nodes["a"].tier.env)}  # before the pass drops stale copies
    asked = _asked_roots(r)
    fleet.one_pass(r)
    assert asked == held
