"""The vLLM connector over a fleet (docs/FLEET.md F58-F61): vLLM's REAL v1 Scheduler and the connector made by vLLM's
factory, configured with the fleet's `etcd://` address (or its gateway's host:port) as `kv_connector_extra_config`'s
target, against one real etcd, three real `kvstore serve` nodes at replication 2 whose SWA pool is one real Redis
Cluster, and a real `kvstore gateway` in front of them (fleet_support.py).

Harness: test_vllm_support.py (skips, with the reason, only when vLLM cannot be imported). The test that kills a
node runs last in the module and leaves two.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kvstore
from kvstore.client.fleet import FleetClient
from kvstore.errors import ConfigError
from tests.integrations.fleet_support import (
    REPLICATION,
    Fleet,
    failovers,
    first_reads,
    fleet_fixture,
    node_errors,
    spread_prompt,
)
from tests.integrations.test_vllm_support import (
    GEO,
    PAGE,
    STORE_BLOCK_TOKENS,
    Engine,
    assert_rows_loaded,
    expected_block,
    extra,
    prompt,
    window_row,
)

B = STORE_BLOCK_TOKENS
#: Full blocks of the stored prompt: 5 runs of 2.
BLOCKS = 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_cluster_session: Any) -> Iterator[Fleet]:
    yield from fleet_fixture(tmp_path_factory.mktemp("vllm-fleet"), block_tokens=B,
                             swa_nodes=redis_cluster_session.startup_nodes, gateway=True)


def fleet_extra(fleet: Fleet, **more: object) -> dict[str, object]:
    """kv_connector_extra_config as a user writes it for a fleet: the etcd:// address as the target."""
    return extra(SimpleNamespace(target=fleet.address), **more)


def gateway_extra(fleet: Fleet, **more: object) -> dict[str, object]:
    """kv_connector_extra_config naming the fleet's gateway (host:port) as the target."""
    assert fleet.gateway is not None
    return extra(SimpleNamespace(target=fleet.gateway.target), **more)


def spread(fleet: Fleet, base: int, also: Any = None) -> tuple[int, list[int]]:
    """A prompt of BLOCKS blocks and a few tokens whose runs lie on every node (a test's own: seeds from `base`)."""
    with fleet.client(geometry=GEO.name) as client:
        return spread_prompt(fleet, lambda seed: prompt(BLOCKS * B + 4, seed=base + seed), client.hashes, also=also)


def store_through_vllm(fleet: Fleet, model_dir: Path, tokens: list[int], *, hybrid: bool = False,
                       settings: dict[str, object] | None = None) -> None:
    """One engine with the connector on the fleet (or `settings`) runs `tokens` until its blocks (and, `hybrid`,
    the snapshot at the prompt's last block boundary) are saved."""
    first = Engine(model_dir, settings or fleet_extra(fleet), hybrid=hybrid)
    first.add("r1", tokens)
    first.run()
    first.drain()
    saves = first.worker.worker.saves
    assert saves.save_errors == 0 and saves.snapshots_saved == int(hybrid)
    first.close()


#: The snapshot the hybrid prompt's store puts: at its last block boundary.
AT = BLOCKS * B


def window(tokens: list[int], at: int = AT) -> bytes:
    """The snapshot at T = `at` as the stand-in model's window rows make it (every layer's last window rows)."""
    return b"".join(window_row(tokens, layer, p) for layer in range(GEO.num_layers) for p in range(at - GEO.window, at))


def assert_resumed_from_the_snapshot(engine: Engine, req_id: str, tokens: list[int], at: int = AT) -> None:
    """A fetch+snapshot resume at `at`: the plan, the blocks and the window loaded (vLLM computes from `at` on, with
    the window rows of the snapshot in its window pages) and the global rows byte for byte."""
    engine.step()  # the load runs (asynchronously for vLLM: several KV cache groups); the request waits for it
    plan = engine.connector.scheduler.plan_of(req_id)
    assert plan.action.value == "fetch+snapshot" and plan.resume_tokens == at
    loads = engine.worker.worker.loads
    assert (loads.blocks_loaded, loads.snapshots_loaded) == (at // B, 1)
    so = engine.step()
    assert so.num_scheduled_tokens == {req_id: len(tokens) - at}
    rb = GEO.window_row_bytes
    for layer in range(GEO.num_layers):
        cache = engine.caches[f"model.layers.{layer}.self_attn.swa_cache"][:, : PAGE * rb].view(-1, PAGE, rb)
        for pos in range(at - GEO.window, at):
            page = engine.pages[req_id][1][pos // PAGE]
            assert bytes(cache[page, pos % PAGE].tolist()) == window_row(tokens, layer, pos), (layer, pos)
    assert_rows_loaded(engine, req_id, tokens, loaded_tokens=at)


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
    # `grpc`: each run streamed from its nearest replica (on "auto", this host's nodes may copy theirs over shm).
    engine = Engine(tmp_path / "b", fleet_extra(fleet, path="grpc"))
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
    assert engine.worker.worker.loads.load_paths == {"grpc": 1}
    assert failovers() == moved  # each run read from a node that holds it
    engine.run()
    engine.drain()
    engine.close()
    assert engine.connector.scheduler.planner.background_errors == 0
    with fleet.client(geometry=GEO.name) as client:
        assert sum(s.resume_plans for s in client.node_stats().values()) == plans_before + 1
        # The new turn's blocks went on, chained to the ones found (runs 5.. bridged to the prefix, F29).
        assert client.lookup(engine.tokens["r2"]).found_tokens == len(engine.tokens["r2"]) // B * B


def test_f59_a_hybrid_prompt_stored_through_vllm_on_a_fleet_resumes_from_its_snapshot_in_another_engine(
        fleet: Fleet, tmp_path: Path) -> None:
    """F59: vLLM's hybrid layout over a fleet: the window rows at the prompt's last block boundary are one snapshot
    in the nodes' shared pool, keyed on the fleet's chain, a hit through every node; a second engine plans a
    fetch+snapshot resume there and loads the blocks and the window byte for byte."""
    _, tokens = spread(fleet, 700)
    store_through_vllm(fleet, tmp_path / "a", tokens, hybrid=True)
    with fleet.client(geometry=GEO.name) as client:
        key = client.swa.key(tokens[:AT], AT)
        for node in fleet.nodes:  # the pool is the nodes' one (F44): each finds the snapshot a fleet engine put
            with kvstore.Client(node.child.target, geometry=GEO.name) as direct:
                got = direct.swa.get_many([key])[0]
                assert got is not None and bytes(got) == window(tokens), node.node_id
    moved = failovers()
    engine = Engine(tmp_path / "b", fleet_extra(fleet), hybrid=True)
    turn2 = [*tokens, 7, 7]
    engine.add("r2", turn2, max_tokens=2)
    assert_resumed_from_the_snapshot(engine, "r2", turn2)
    assert failovers() == moved
    engine.run()
    engine.close()


def test_f60_vllm_through_a_gateway_stores_and_resumes_a_hybrid_prompt(fleet: Fleet, tmp_path: Path) -> None:
    """F60: the connector with the gateway's host:port as its target: its blocks and snapshot stored through the
    gateway are the fleet's (a fleet client finds both), and a second engine through the gateway resumes from
    them byte for byte, the blocks streamed (the gateway holds none to map)."""
    _, tokens = spread(fleet, 800)
    store_through_vllm(fleet, tmp_path / "a", tokens, hybrid=True, settings=gateway_extra(fleet))
    with fleet.client(geometry=GEO.name) as client:
        assert client.lookup(tokens, swa_positions=[AT]).swa_position == AT
        got = client.swa.get(tokens[:AT], AT)
        assert got is not None and bytes(got) == window(tokens)
        want = [expected_block(tokens, i) for i in range(BLOCKS)]
        assert [bytes(b or b"") for b in client.get(tokens).blocks] == want
    engine = Engine(tmp_path / "b", gateway_extra(fleet), hybrid=True)
    assert not isinstance(engine.worker.worker.client, FleetClient)  # a plain client of the gateway
    turn2 = [*tokens, 5, 5]
    engine.add("r2", turn2, max_tokens=2)
    assert_resumed_from_the_snapshot(engine, "r2", turn2)
    assert engine.worker.worker.loads.load_paths == {"grpc": 1}
    engine.run()
    engine.close()


@pytest.mark.parametrize("path", ["shm", "direct-cpu", "direct-gpu"])
def test_f60_a_load_path_a_gateway_cannot_serve_is_refused_naming_the_fleets_address(
        fleet: Fleet, tmp_path: Path, path: str) -> None:
    """F60: shm and the direct paths map or read a node's own store; through a gateway the connector is refused at
    creation, a ConfigError naming the etcd:// address (and the paths that work through a gateway)."""
    data_dir = {"data_dir": str(next(iter(fleet.data_dirs.values())))} if path.startswith("direct") else {}
    with pytest.raises(ConfigError, match="etcd://") as refused:
        Engine(tmp_path / path, gateway_extra(fleet, path=path, **data_dir))
    assert path in str(refused.value) and "grpc" in str(refused.value)


def test_f61_vllm_direct_cpu_over_a_fleet_reads_the_local_nodes_runs_from_its_file(
        fleet: Fleet, tmp_path: Path) -> None:
    """F61: `path: direct-cpu` with a node's `data_dir` over a fleet: the runs that node holds are read from its
    file in this process (F48), the others streamed from their replicas; the rows loaded byte for byte."""
    local = fleet.nodes[0].node_id
    with fleet.client(geometry=GEO.name) as client:  # the node holds some runs, not all ((2/3)^5 = 13% of prompts do)
        _, tokens = spread(fleet, 900, also=lambda chain: not all(local in r.replicas for r in client.placement(chain)))
    store_through_vllm(fleet, tmp_path / "a", tokens)
    with fleet.client(geometry=GEO.name) as client:
        chain = client.hashes(tokens)
        placed = client.placement(chain)
    held = [r for r, run in enumerate(placed) if local in run.replicas]
    assert 0 < len(held) < len(placed)  # some runs from the node's file, some streamed (the prompt spans every node)
    engine = Engine(tmp_path / "b", fleet_extra(fleet, path="direct-cpu", data_dir=str(fleet.data_dirs[local])))
    turn2 = [*tokens, 3]
    engine.add("r2", turn2, max_tokens=2)
    so = engine.step()
    usable = (BLOCKS * B - GEO.window) // PAGE * PAGE
    assert so.scheduled_new_reqs[0].num_computed_tokens == usable
    assert_rows_loaded(engine, "r2", turn2, loaded_tokens=usable)
    assert engine.worker.worker.loads.load_paths == {"direct-cpu": 1}
    engine.run()
    engine.close()


def test_f58_a_node_killed_after_the_store_costs_vllm_nothing(fleet: Fleet, tmp_path: Path) -> None:
    """F58, F59, F33, F45: the node the next engine's worker reads run 0 from first, and reaches the SWA pool
    through, is SIGKILLed after a hybrid prompt is stored (still in the view: its lease has not ended); that
    engine still resumes from the snapshot, the blocks from the other replicas and the window through another
    node of the pool, byte for byte."""
    # `grpc`: each run streamed from the first live node of its read order (F33), which the test picks.
    engine = Engine(tmp_path / "b", fleet_extra(fleet, path="grpc"), hybrid=True)
    worker_client = engine.worker.worker.client  # the worker's own FleetClient, with its own read order (F33)
    victim = worker_client.swa.node_id  # the pool's node it asks first (F45)
    _, tokens = spread(fleet, 300, also=lambda chain: first_reads(worker_client, chain)[0] == victim)
    store_through_vllm(fleet, tmp_path / "a", tokens, hybrid=True)
    fleet.node(victim).child.kill9()
    moved, failed = failovers(), node_errors(victim)

    turn2 = [*tokens, 3, 3]
    engine.add("r2", turn2, max_tokens=2)
    assert_resumed_from_the_snapshot(engine, "r2", turn2)
    assert failovers() > moved  # run 0 came from its other replica
    assert worker_client.swa.node_id != victim and node_errors(victim) > failed  # the window through another node
    engine.run()
    engine.close()
