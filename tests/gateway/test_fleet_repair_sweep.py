"""A periodic pass sweeps a big node's runs in parts (gateway/fleet_repair.py, docs/FLEET.md F87): over the settled
view, each pass plans the next SWEEP_RUNS runs in key order after the last pass's, wrapping, so a node of many runs
spreads its periodic checks over several passes instead of reading every block's record each time. A real etcd, two
in-process nodes on loopback (real LMDB, real gRPC)."""

from __future__ import annotations

import pytest

from gateway import fleet_repair
from gateway.fleet_repair import sweep
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import SCOPE, chain, put
from tests.gateway.test_fleet_repair_moved import _asked_roots, _runs_on_a
from tiers import run_index
from tiers.run_index import RunEntry

PART = 15


def test_f87_periodic_passes_sweep_the_runs_in_parts_and_each_part_finds_what_it_lacks(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settled over {a, b}, then 20 runs stored on a alone (as a Put half-stored would leave them): each periodic
    pass asks about the next PART runs in key order, the fourth covers the last of the 60, the fifth wraps to the
    first; after each, b holds exactly the late runs swept so far."""
    monkeypatch.setattr(fleet_repair, "SWEEP_RUNS", PART)
    view, _ = _runs_on_a(fleet)
    r = fleet.repairer("a", view)
    assert fleet.one_pass(r).failed_runs == 0  # the first pass plans every run: settled
    late = [chain(1, seed=900 + i) for i in range(20)]
    for hashes, blocks in late:
        put(fleet.nodes["a"].tier, hashes, blocks)
    keys = [e.key for e in run_index.list_runs(fleet.nodes["a"].tier.env)]
    assert len(keys) == 4 * PART
    late_keys = {SCOPE.key(hashes[0]) for hashes, _ in late}
    b = fleet.nodes["b"].tier
    for k in range(4):
        asked = _asked_roots(r)
        progress = fleet.one_pass(r)
        assert progress.failed_runs == 0
        part = set(keys[k * PART:(k + 1) * PART])
        assert asked == part
        assert (progress.pass_runs, progress.held_runs) == (PART, 4 * PART)  # what `kvstore fleet status` shows
        swept = set(keys[:(k + 1) * PART])
        assert {key for key in late_keys if run_index.held(b.env, [key])[0]} == late_keys & swept
    asked = _asked_roots(r)
    fleet.one_pass(r)
    assert asked == set(keys[:PART])  # wrapped


def test_f87_sweep_takes_the_next_runs_after_the_last_key_and_wraps() -> None:
    runs = [RunEntry(key=bytes([i]) * 40, first_block=0) for i in range(10)]
    part, last = sweep(runs, b"", 4)
    assert part == runs[:4] and last == runs[3].key
    part, last = sweep(runs, last, 4)
    assert part == runs[4:8]
    part, last = sweep(runs, last, 4)
    assert part == runs[8:] + runs[:2] and last == runs[1].key
    gone = runs[:5] + runs[6:]  # the run after the last key left the store: the sweep goes on after it
    assert sweep(gone, runs[4].key, 2)[0] == [runs[6], runs[7]]
    assert sweep(runs, b"x", 10) == (runs, b"")  # all of them: the next sweep starts at the first
