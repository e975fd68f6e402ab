"""A stale copy's drop in the repairer's pass (gateway/fleet_repair.py, docs/FLEET.md F79) against a real etcd and
three in-process nodes on loopback (real LMDB, real gRPC): every run stored on all three, so each node holds the
runs it is not a replica of at replication 2, whose two replicas hold them whole with the same last uses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.fleet.placement import replicas
from kvstore.fleet.repair_progress import RepairProgress
from tests.conftest import LoopThread
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import RUN_BLOCKS, SCOPE, chain, put
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import run_index
from tiers.lmdb_tier import LmdbBlockTier

LIVE = ["a", "b", "c"]
#: Seconds a view takes at most to see etcd gone, or back.
EVENT_S = 15.0


def _store_everywhere(tiers: dict[str, LmdbBlockTier]) -> tuple[list[tuple[list[bytes], list[bytes]]],
                                                                 list[tuple[list[bytes], list[bytes]]]]:
    """Chains of one run each on every node: (all of them, those node a is not a replica of)."""
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3, 4, 4, 2, 1])]
    assert all(len(hashes) <= RUN_BLOCKS for hashes, _ in chains)  # one run each, placed by its first hash
    for hashes, blocks in chains:
        for tier in tiers.values():
            put(tier, hashes, blocks)
    stale = [(h, b) for h, b in chains if "a" not in replicas(h[0], LIVE, 2)]
    assert stale and len(stale) < len(chains)
    return chains, stale


@pytest.fixture
def own(tmp_path: Path, loop_thread: LoopThread) -> Iterator[tuple[Fleet, EtcdProcess]]:
    """A fleet on an etcd of this test's own (to kill and start again), and that etcd."""
    etcd = EtcdProcess(tmp_path / "etcd")
    etcd.start()
    fleet = Fleet(tmp_path / "nodes", etcd, loop_thread)
    try:
        yield fleet, etcd
    finally:
        if etcd.process is None or etcd.process.poll() is not None:
            etcd.start()  # back, so the nodes deregister and the views close
        fleet.close()
        etcd.stop()


def test_f79_a_stale_copy_is_kept_in_a_pass_whose_etcd_did_not_answer(fleet: Fleet) -> None:
    tiers, _, view = fleet.start(LIVE)
    chains, stale = _store_everywhere(tiers)
    r = fleet.repairer("a", view)

    async def etcd_away() -> bool | None:
        return None  # the drain check's answer when etcd does not answer

    async def no_drain() -> bool | None:
        return False

    r.drain_requested = etcd_away
    assert fleet.one_pass(r).stale_dropped_runs == 0  # in doubt: kept
    assert len(run_index.list_runs(tiers["a"].env)) == len(chains)
    r.drain_requested = no_drain
    progress = fleet.one_pass(r)
    assert (progress.stale_dropped_runs, progress.stale_dropped_bytes) == (
        len(stale), sum(len(x) for _, blocks in stale for x in blocks))
    for hashes, blocks in chains:  # a keeps what it is a replica of; b and c keep everything
        keys = [SCOPE.key(h) for h in hashes]
        assert run_index.held(tiers["a"].env, keys) == [(hashes, blocks) not in stale] * len(keys)
        assert all(run_index.held(tiers["b"].env, keys)) and all(run_index.held(tiers["c"].env, keys))


def test_f79_a_stale_copy_is_kept_when_the_view_goes_stale_during_the_pass(own: tuple[Fleet, EtcdProcess]) -> None:
    fleet, etcd = own
    tiers, _, view = fleet.start(LIVE)
    chains, stale = _store_everywhere(tiers)
    r = fleet.repairer("a", view)

    async def etcd_goes(progress: RepairProgress) -> None:
        # The pass's first publish comes after its own check of the view (F7): etcd is killed there, so the pass
        # plans over a view that went stale under it (its peers answer over gRPC, without etcd).
        if not view.stale:
            await asyncio.to_thread(etcd.stop)
            await view.wait_until(lambda m: m.stale, EVENT_S)

    r.publish = etcd_goes
    progress = fleet.one_pass(r)
    assert view.stale and progress.passes == 1 and progress.stale_dropped_runs == 0  # in doubt: kept
    assert len(run_index.list_runs(tiers["a"].env)) == len(chains)
    r.publish = None
    etcd.start()  # same ports, same data
    fleet.loop.run(view.wait_until(lambda m: not m.stale, EVENT_S))
    assert fleet.one_pass(r).stale_dropped_runs == len(stale)
    assert len(run_index.list_runs(tiers["a"].env)) == len(chains) - len(stale)


def test_f79_a_draining_node_keeps_its_copies(fleet: Fleet) -> None:
    tiers, _, view = fleet.start(LIVE)
    chains, _ = _store_everywhere(tiers)
    r = fleet.repairer("a", view)

    async def drain() -> bool | None:
        return True  # `kvstore fleet drain a` (F21): its record is not marked here, no one needs it to be

    r.drain_requested = drain
    progress = fleet.one_pass(r)
    assert progress.draining and progress.drained  # b and c hold every run whole: the drain is done
    assert progress.stale_dropped_runs == 0  # its copies stay until it is stopped (F21's own path)
    assert len(run_index.list_runs(tiers["a"].env)) == len(chains)


def test_f80_a_rounds_stale_copies_are_asked_about_after_its_copies_are_answered(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """F80: in a round with runs to copy and stale copies to drop, every CopyBlocks is answered before the first
    RaiseUses is asked (the stale step's round trips and write transactions do not delay a copy); both are done."""
    from gateway import fleet_repair

    monkeypatch.setattr(fleet_repair, "FIRST_ROUND_RUNS", fleet_repair.RUNS_PER_ROUND)  # the pass is one round
    tiers, _, view = fleet.start(LIVE)
    _, stale = _store_everywhere(tiers)
    alone = [(h, b) for h, b in (chain(n, seed=50 + i) for i, n in enumerate([3, 2, 4, 1, 2, 3]))
             if "a" in replicas(h[0], LIVE, 2)]
    assert alone
    for hashes, blocks in alone:  # only on a, one of their replicas: a sends them to the other
        put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    events: list[str] = []
    deliver, raise_uses = r._deliver, r._raise_uses

    async def delivered(*args: object, **kwargs: object) -> bool:
        went = await deliver(*args, **kwargs)  # type: ignore[arg-type]
        events.append("copied")
        return went

    async def raised(*args: object, **kwargs: object) -> list[bool]:
        events.append("raise")
        return await raise_uses(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(r, "_deliver", delivered)
    monkeypatch.setattr(r, "_raise_uses", raised)
    progress = fleet.one_pass(r)
    assert progress.stale_dropped_runs == len(stale) and progress.copied_blocks == sum(len(h) for h, _ in alone)
    assert "copied" in events and "raise" in events
    assert events.index("raise") > max(i for i, e in enumerate(events) if e == "copied")


def test_f84_a_rounds_stale_copies_are_dropped_in_one_write_transaction(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """F84: a pass of one round drops its stale copies (several runs) in one durable write transaction on the node
    dropping them, not one each; every stale run goes, the rest stays."""
    from gateway import fleet_repair

    monkeypatch.setattr(fleet_repair, "FIRST_ROUND_RUNS", fleet_repair.RUNS_PER_ROUND)  # the pass is one round
    tiers, _, view = fleet.start(LIVE)
    chains, stale = _store_everywhere(tiers)
    assert len(stale) >= 2
    a = tiers["a"]
    before = a.env.info()["last_txnid"]
    progress = fleet.one_pass(fleet.repairer("a", view))
    assert (progress.stale_dropped_runs, progress.copied_blocks) == (len(stale), 0)
    assert a.env.info()["last_txnid"] - before == 1  # a writes nothing else in this pass: its copies go nowhere
    assert len(run_index.list_runs(a.env)) == len(chains) - len(stale)
