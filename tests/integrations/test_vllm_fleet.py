"""The vLLM connector over a fleet (docs/FLEET.md F58): vLLM's REAL v1 Scheduler and the connector made by vLLM's
factory, configured with the fleet's `etcd://` address as `kv_connector_extra_config`'s target, against one real
etcd and three real `kvstore serve` nodes at replication 2 (fleet_support.py).

Harness: test_vllm_support.py (skips, with the reason, only when vLLM cannot be imported). The test that kills a
node runs last in the module and leaves two.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integrations.fleet_support import REPLICATION, Fleet, failovers, fleet_fixture, spread_prompt
from tests.integrations.test_vllm_support import (
    GEO,
    PAGE,
    STORE_BLOCK_TOKENS,
    Engine,
    assert_rows_loaded,
    expected_block,
    extra,
    prompt,
)

B = STORE_BLOCK_TOKENS
#: Full blocks of the stored prompt: 5 runs of 2.
BLOCKS = 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from fleet_fixture(tmp_path_factory.mktemp("vllm-fleet"), block_tokens=B)


def fleet_extra(fleet: Fleet, **more: object) -> dict[str, object]:
    """kv_connector_extra_config as a user writes it for a fleet: the etcd:// address as the target."""
    return extra(SimpleNamespace(target=fleet.address), **more)


def spread(fleet: Fleet, base: int) -> tuple[int, list[int]]:
    """A prompt of BLOCKS blocks and a few tokens whose runs lie on every node (a test's own: seeds from `base`)."""
    with fleet.client(geometry=GEO.name) as client:
        return spread_prompt(fleet, lambda seed: prompt(BLOCKS * B + 4, seed=base + seed), client.hashes)


def store_through_vllm(fleet: Fleet, model_dir: Path, tokens: list[int]) -> None:
    """One engine with the connector on the fleet runs `tokens` until its blocks are saved."""
    first = Engine(model_dir, fleet_extra(fleet))
    first.add("r1", tokens)
    first.run()
    first.drain()
    assert first.worker.worker.saves.save_errors == 0
    first.close()


def test_f58_a_prompt_stored_through_vllm_on_a_fleet_is_loaded_back_by_another_engine(
        fleet: Fleet, tmp_path: Path) -> None:
    """F58: saved block by block over the fleet (each run on its 2 replicas, the runs over every node), then a
    second engine's planner finds it all, plans the bounded replay, reports the plan to a node, and its worker
    loads the usable tokens byte for byte from the nodes."""
    seed, tokens = spread(fleet, 100)
    store_through_vllm(fleet, tmp_path / "a", tokens)
    with fleet.client(geometry=GEO.name) as client:
        chain = client.hashes(tokens)
        assert client.lookup(tokens).found_tokens == BLOCKS * B
        got = client.get(tokens)
        assert [bytes(b or b"") for b in got.blocks] == [expected_block(tokens, i) for i in range(BLOCKS)]
        held = fleet.held_by(chain, geometry=GEO.name)
        for r, run in enumerate(client.placement(chain)):
            assert len(run.replicas) == REPLICATION
            assert {n for n, found in held.items() if found[r]} == set(run.replicas), f"run {r}"
            assert all(held[n][r] == run.end_block - run.first_block for n in run.replicas)
        assert sum(1 for found in held.values() if any(found)) == 3  # the runs are spread, not on one pair
        plans_before = sum(s.resume_plans for s in client.node_stats().values())

    moved = failovers()
    engine = Engine(tmp_path / "b", fleet_extra(fleet))
    turn2 = tokens + prompt(30, seed=500 + seed)
    engine.add("r2", turn2, max_tokens=2)
    so = engine.step()
    plan = engine.connector.scheduler.plan_of("r2")
    assert plan.found_tokens == BLOCKS * B and plan.action.value == "bounded-replay"
    assert plan.replay_start == BLOCKS * B - GEO.window
    usable = (BLOCKS * B - GEO.window) // PAGE * PAGE
    assert so.scheduled_new_reqs[0].num_computed_tokens == usable
    assert_rows_loaded(engine, "r2", turn2, loaded_tokens=usable)
    assert engine.worker.worker.loads.blocks_loaded == usable // B
    assert engine.worker.worker.loads.load_paths == {"grpc": 1}  # no node's file is this process's: streamed
    assert failovers() == moved  # each run read from a node that holds it
    engine.run()
    engine.drain()
    engine.close()
    assert engine.connector.scheduler.planner.background_errors == 0
    with fleet.client(geometry=GEO.name) as client:
        assert sum(s.resume_plans for s in client.node_stats().values()) == plans_before + 1
        # The new turn's blocks went on, chained to the ones found (runs 5.. bridged to the prefix, F29).
        assert client.lookup(engine.tokens["r2"]).found_tokens == len(engine.tokens["r2"]) // B * B


def test_f58_a_node_killed_after_the_store_costs_vllm_nothing(fleet: Fleet, tmp_path: Path) -> None:
    """F58, F33: a node SIGKILLed after the prompt is stored (still in the view: its lease has not ended) holds
    the read-first copy of some runs; the next engine still finds the whole prompt and loads it byte for byte
    from the other replicas."""
    _, tokens = spread(fleet, 300)
    store_through_vllm(fleet, tmp_path / "a", tokens)
    engine = Engine(tmp_path / "b", fleet_extra(fleet))
    worker_client = engine.worker.worker.client  # the worker's own FleetClient, with its own read order (F33)
    chain = worker_client.hashes(tokens)
    first_read = [worker_client.pool.read_order(chain[run.first_block], list(run.replicas))[0]
                  for run in worker_client.placement(chain)]
    victim = next(n for n in fleet.nodes if n.node_id == first_read[0])
    victim.child.kill9()
    moved = failovers()

    turn2 = [*tokens, 3, 3]
    engine.add("r2", turn2, max_tokens=2)
    so = engine.step()
    plan = engine.connector.scheduler.plan_of("r2")
    assert plan.found_tokens == BLOCKS * B
    usable = (BLOCKS * B - GEO.window) // PAGE * PAGE
    assert so.scheduled_new_reqs[0].num_computed_tokens == usable
    assert_rows_loaded(engine, "r2", turn2, loaded_tokens=usable)
    assert failovers() > moved  # run 0 came from its other replica
    engine.run()
    engine.close()
