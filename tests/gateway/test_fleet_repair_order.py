"""The order of a pass's rounds (gateway/fleet_repair.py, docs/FLEET.md F18b): the runs read ahead are planned
biggest first, and rounds copy beside each other within the blocks they hold. A real etcd, two in-process nodes on
loopback (real LMDB, real gRPC)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import fleet_repair
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import RUN_BLOCKS, SCOPE, chain, put
from tiers import run_index

#: One-block runs stored beside the big run: rounds of 8 (the first), 16, 32 and 32 over the 71 runs.
SMALL_RUNS = 70


def _small_and_big(fleet: Fleet) -> tuple[Any, list[tuple[list[bytes], list[bytes]]], tuple[list[bytes], list[bytes]]]:
    """Nodes a and b, a holding SMALL_RUNS one-block runs and one run of RUN_BLOCKS blocks listed at 24 or later
    (past the first two rounds in the run index's order, inside what a pass reads ahead): (view, small, big)."""
    tiers, _, view = fleet.start(["a", "b"])
    small = [chain(1, seed=300 + i) for i in range(SMALL_RUNS)]
    for hashes, blocks in small:
        put(tiers["a"], hashes, blocks)
    keys = sorted(SCOPE.key(hashes[0]) for hashes, _ in small)
    seed = next(s for s in range(1000, 2000)  # deterministic: the first chain whose root lists at 24..48
                if keys[24] < SCOPE.key(chain(1, seed=s)[0][0]) < keys[48])
    big = chain(RUN_BLOCKS, seed=seed)
    put(tiers["a"], *big)
    return view, small, big


def _all_on_b(fleet: Fleet, runs: list[tuple[list[bytes], list[bytes]]]) -> None:
    b = fleet.nodes["b"].tier
    for hashes, blocks in runs:
        assert [data for _, data in b.read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18b_a_big_run_read_ahead_is_planned_before_the_small_runs_listed_before_it(fleet: Fleet) -> None:
    """The big run lists past the first two rounds; read ahead with the runs after the first round, it is planned
    first among them (the second round's RunDigests asks about it), and the pass still copies every run once."""
    view, small, big = _small_and_big(fleet)
    a = fleet.nodes["a"].tier
    roots = [e.key for e in run_index.list_runs(a.env)]
    assert roots.index(SCOPE.key(big[0][0])) >= 2 * fleet_repair.FIRST_ROUND_RUNS + 8  # not in round 1 or 2 by order
    r = fleet.repairer("a", view)
    ask = r._ask
    asked: list[list[bytes]] = []

    async def watched(peer: str, address: str, method: str, request: Any) -> Any:
        if method == "RunDigests":
            asked.append(list(request.run_roots))
        return await ask(peer, address, method, request)

    r._ask = watched  # type: ignore[method-assign]
    progress = fleet.one_pass(r)
    # Round 1 and the read-ahead's round are planned at once (F18a): either may ask first.
    first = roots[:fleet_repair.FIRST_ROUND_RUNS]
    later = [x for x in asked if x != first]
    assert len(asked) >= 3 and first in asked and SCOPE.key(big[0][0]) in later[0]
    assert later[0][0] == SCOPE.key(big[0][0])  # the biggest first
    total = sum(len(x) for _, blocks in [*small, big] for x in blocks)
    assert (progress.copied_bytes, progress.under_replicated_bytes, progress.failed_runs) == (total, 0, 0)
    _all_on_b(fleet, [*small, big])


def _rounds_watched(r: Any) -> dict[str, Any]:
    """Count `r`'s rounds copying at once (`most`) around its `_copy_round`."""
    seen: dict[str, Any] = {"copying": 0, "most": 0}
    copy_round = r._copy_round

    async def counted(*args: Any, **kwargs: Any) -> None:
        seen["copying"] += 1
        seen["most"] = max(seen["most"], seen["copying"])
        try:
            await copy_round(*args, **kwargs)
        finally:
            seen["copying"] -= 1

    r._copy_round = counted
    return seen


def test_f18b_rounds_of_small_runs_copy_beside_a_big_one_held(fleet: Fleet) -> None:
    """The big run's call is held until every small run of the other calls is stored on b: the rounds after its own
    copy beside it, so more than COPYING_ROUNDS rounds copy at once; the pass then copies every run once."""
    view, small, big = _small_and_big(fleet)
    r = fleet.repairer("a", view)
    b = fleet.nodes["b"].tier
    small_keys = [SCOPE.key(hashes[0]) for hashes, _ in small]
    copier = r.peers.copier
    seen = _rounds_watched(r)
    seen["waited"] = False

    def counted(address: str) -> Any:
        call = copier(address)

        async def copy(request: bytes, **kwargs: Any) -> Any:
            if SCOPE.key(big[0][0]) in request:  # the big run's call waits for the small runs of other calls
                others = [k for k in small_keys if k not in request]
                for _ in range(1000):  # up to 10 s
                    if all(run_index.held(b.env, others)):
                        seen["waited"] = True
                        break
                    await asyncio.sleep(0.01)  # polling b's store while this call is held, under the bound above
            return await call(request, **kwargs)

        return copy

    r.peers.copier = counted  # type: ignore[method-assign]
    progress = fleet.one_pass(r)
    assert seen["waited"] and seen["most"] > fleet_repair.COPYING_ROUNDS
    total = sum(len(x) for _, blocks in [*small, big] for x in blocks)
    assert (progress.copied_bytes, progress.under_replicated_bytes, progress.failed_runs) == (total, 0, 0)
    _all_on_b(fleet, [*small, big])


def test_f18b_rounds_wait_once_the_copying_ones_hold_their_bound(fleet: Fleet,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With no room for two rounds' blocks (COPYING_ROUNDS 0), a planned round waits for the one copying: the
    first round's call is held until the third round is planned, and still no two rounds copy at once."""
    monkeypatch.setattr(fleet_repair, "COPYING_ROUNDS", 0)
    view, small, big = _small_and_big(fleet)
    r = fleet.repairer("a", view)
    seen = _rounds_watched(r)
    planned = {"rounds": 0}
    third = asyncio.Event()
    plan_round = r.plan_round

    async def counted_plan(*args: Any, **kwargs: Any) -> Any:
        found = await plan_round(*args, **kwargs)
        planned["rounds"] += 1
        if planned["rounds"] == 3:
            third.set()
        return found

    r.plan_round = counted_plan  # type: ignore[method-assign]
    copier = r.peers.copier
    calls = {"n": 0}

    def held(address: str) -> Any:
        call = copier(address)

        async def copy(request: bytes, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:  # the first round's call: held until a third round is planned (at most 10 s)
                await asyncio.wait_for(third.wait(), 10.0)
            return await call(request, **kwargs)

        return copy

    r.peers.copier = held  # type: ignore[method-assign]
    progress = fleet.one_pass(r)
    assert planned["rounds"] >= 3 and seen["most"] == 1
    assert (progress.under_replicated_bytes, progress.failed_runs) == (0, 0)
    _all_on_b(fleet, [*small, big])
