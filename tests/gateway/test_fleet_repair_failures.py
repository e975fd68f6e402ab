"""The repairer when a peer is not there (gateway/fleet_repair.py, docs/FLEET.md F18): a real etcd, in-process
nodes on loopback (real LMDB, real gRPC), a node's server stopped and started again on its port while its
registration stays in etcd (as a killed or SIGSTOPped node's does until its lease ends)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from kvstore.fleet.membership import NodeRecord, Registration, session_for
from kvstore.fleet.placement import replicas
from tests.conftest import LoopThread
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import RUN_BLOCKS, SCOPE, chain, put
from tests.waiting import wait_until
from tiers import run_index


def stored(fleet: Fleet, name: str, n_chains: int) -> tuple[list[tuple[list[bytes], list[bytes]]], int]:
    """Chains of one run each put on node `name`; the chains and their bytes."""
    chains = [chain(RUN_BLOCKS, seed=100 + i) for i in range(n_chains)]
    for hashes, blocks in chains:
        put(fleet.nodes[name].tier, hashes, blocks)
    return chains, sum(len(b) for _, blocks in chains for b in blocks)


def test_f18_a_node_that_does_not_answer_leaves_every_run_it_ranks_in_under_replicated(
        fleet: Fleet, loop_thread: LoopThread) -> None:
    """A node in the view that does not answer (killed, its lease not ended; restarted and not dialed yet):
    a run it is a replica of, or that it ranks above this holder in (it may hold the run and act), is
    counted under-replicated and failed, not skipped, so the fleet is not reported settled until a pass
    copies it; every other run is copied to its replicas as usual."""
    for name in ("a", "b", "c"):
        fleet.node(name)
    x = fleet.node("x")
    live = ["a", "b", "c", "x"]
    view = fleet.view(len(live))
    chains, _ = stored(fleet, "a", 48)
    undecided = copied = 0
    cases = set()
    for hashes, blocks in chains:
        order = replicas(hashes[0], live, len(live))
        size = sum(map(len, blocks))
        if "x" in order[:2] or "x" in order[:order.index("a")]:
            undecided += size
            cases.add("replica" if "x" in order[:2] else "above")
        else:
            copied += size * len({*order[:2]} - {"a"})
    assert cases == {"replica", "above"}  # both ways of depending on the node are met
    loop_thread.run(x.halt())
    progress = fleet.one_pass(fleet.repairer("a", view))
    assert (progress.under_replicated_bytes, progress.copied_bytes) == (undecided, copied)
    assert progress.failed_runs == progress.under_replicated_runs > 0 and not progress.running


def test_f18_a_copy_that_fails_stays_counted_until_made(fleet: Fleet, loop_thread: LoopThread) -> None:
    """Planned while the replica answered, the copy fails (its server stopped): the bytes stay
    under-replicated and the runs failed; once it serves again on its address, the next pass copies them
    at once (the channel that failed is dialed afresh, not left in gRPC's reconnect backoff)."""
    fleet.node("a")
    b = fleet.node("b")
    view = fleet.view(2)
    chains, total = stored(fleet, "a", 6)
    r = fleet.repairer("a", view)
    p = r.progress

    async def plan_then_fail() -> None:
        runs = await r.tier.call(run_index.list_runs, r.tier.env)
        r._names = await r.tier.call(run_index.namespace_names, r.tier.env)
        found = await r.plan_round(runs, ["a", "b"], {"a": fleet.nodes["a"].address, "b": b.address})
        assert len(found.plans) == len(chains) and not found.undecided_runs
        p.under_replicated_runs = len(found.plans)
        p.under_replicated_bytes = sum(x.meta.size_bytes for plan in found.plans for s in plan.sends.values()
                                       for x in s)
        await b.halt()
        await r._copy_round(found.plans, {"a": fleet.nodes["a"].address, "b": b.address})

    loop_thread.run(plan_then_fail())
    assert (p.under_replicated_runs, p.under_replicated_bytes, p.failed_runs) == (len(chains), total, len(chains))
    assert p.copied_bytes == 0
    loop_thread.run(b.serve())  # the same port: a node restarted on its address

    progress = fleet.one_pass(r)
    assert (progress.under_replicated_bytes, progress.failed_runs, progress.copied_bytes) == (0, 0, total)
    for hashes, blocks in chains:
        assert [data for _, data in b.tier.read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18_a_pass_is_given_up_when_the_membership_moves(fleet: Fleet, loop_thread: LoopThread) -> None:
    """A pass waiting on a node that accepts connections and never answers (SIGSTOPped) is given up as soon
    as the node leaves the view, and the pass over the new view copies everything."""
    fleet.node("a")
    fleet.node("b")
    chains, total = stored(fleet, "a", 8)
    # A node whose port accepts TCP but never speaks HTTP/2, registered as a node would be.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    accepted = threading.Event()

    def accept() -> None:
        conns = []
        while True:
            try:
                conns.append(hole.accept()[0])
            except OSError:
                break
            accepted.set()
        for c in conns:
            c.close()

    threading.Thread(target=accept, daemon=True).start()
    record = NodeRecord(node_id="stopped", address=f"127.0.0.1:{hole.getsockname()[1]}", host="elsewhere",
                        capacity_bytes=1 << 28, started_at=0.0, version="0")
    stopped = Registration(session_for(fleet.settings), fleet.settings.cluster, record, ttl_s=60)
    loop_thread.run(stopped.start())
    view = fleet.view(3)
    assert any("stopped" in replicas(h[0], ["a", "b", "stopped"], 2) for h, _ in chains)
    r = fleet.repairer("a", view)
    future = asyncio.run_coroutine_threadsafe(r.pass_until_view_moves(), loop_thread.loop)
    wait_until(accepted.is_set, "the pass dialed the stopped node")
    loop_thread.run(stopped.stop())  # it leaves the view (as its lease ending would)
    given_up = future.result(timeout=30)
    assert given_up.running and "stopped" in given_up.planned_nodes  # not finished over the old view
    hole.close()

    async def again() -> Any:
        try:
            return await r.pass_until_view_moves()
        finally:
            await r.peers.close()

    progress = loop_thread.run(again())
    assert progress.planned_nodes == ["a", "b"] and not progress.running
    assert (progress.under_replicated_bytes, progress.failed_runs, progress.copied_bytes) == (0, 0, total)


def test_f18_the_repairers_own_etcd_calls_have_a_session_of_their_own(fleet: Fleet, loop_thread: LoopThread) -> None:
    """The progress record and the drain check go through a session that is neither the view's nor the
    registration's: a session resets its client when a call finds etcd away, and the view's reset under its
    watch's reconnect left the view stale for good once etcd returned (test_failures.py's
    test_f18_re_replication_resumes_once_etcd_is_back failed 2 runs of 3 with one session)."""
    from gateway.fleet_repair import start_repair
    from kvstore.fleet.repair_progress import RepairProgress, repair_key

    node = fleet.node("a")
    assert node.registration is not None

    async def check() -> RepairProgress | None:
        r = await start_repair(node.settings, node.tier, node.registration, None)  # type: ignore[arg-type]
        try:
            assert r.etcd is not None and r.etcd is not r.membership.session
            assert r.etcd is not node.registration.session  # type: ignore[union-attr]
            assert r.publish is not None and r.drain_requested is not None
            await r.publish(r.progress)
            assert not await r.drain_requested()
            key = repair_key(fleet.settings.cluster, "a")
            found = await r.etcd.call(lambda c: c.get(key))
            return None if found is None else RepairProgress.from_json(found.value)
        finally:
            await r.stop()

    record = loop_thread.run(check())
    assert record is not None and record.node_id == "a"
