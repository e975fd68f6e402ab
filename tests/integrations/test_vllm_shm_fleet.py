"""The vLLM connector's `shm` and `auto` load paths over a fleet (docs/FLEET.md F62-F64): vLLM's REAL v1
Scheduler and the connector made by vLLM's factory, configured with the fleet's `etcd://` address, against one
real etcd and three real `kvstore serve` nodes at replication 2, all on this host (fleet_support.py).

The connector's worker loads through `kvstore.client.restore`, which over a fleet opens a fleet transfer session
per load (F63): the region mapped into this host's nodes, the runs they hold copied in by them over shared memory,
the rest streamed. What each load read, and how, is the session's own report (`last_paths`, `blocks_read`,
`shared_with`), taken by wrapping the real session's `fetch` and `register` (nothing is faked), beside each node's
transfer counters (`descriptors_done`: every block a node served, by either path). The test that kills a node runs
last and leaves two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

import kvstore
from kvstore.client.fleet_transfer import FleetTransferSession
from kvstore.fleet.placement import RunPlacement
from kvstore.region import Region
from tests.integrations.fleet_support import Fleet, first_reads, fleet_fixture, spread_prompt
from tests.integrations.test_vllm_fleet import BLOCKS, fleet_extra, store_through_vllm
from tests.integrations.test_vllm_support import GEO, PAGE, STORE_BLOCK_TOKENS, Engine, assert_rows_loaded, prompt

B = STORE_BLOCK_TOKENS
#: The tokens a bounded replay of the stored prompt loads (its last window is recomputed), and their blocks.
USABLE = (BLOCKS * B - GEO.window) // PAGE * PAGE
LOADED = USABLE // B


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from fleet_fixture(tmp_path_factory.mktemp("vllm-shm-fleet"), block_tokens=B)


@dataclass
class Fetched:
    """One fetch of a load's fleet transfer session, as the session reported it once it returned."""

    blocks: int
    paths: list[str]
    read: dict[tuple[str, str], int]
    shared: list[str]


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> list[Fetched]:
    """Every fleet session fetch the test's loads make, with the session's report (the real `fetch`, wrapped)."""
    seen: list[Fetched] = []
    real = FleetTransferSession.fetch

    def fetch(self: FleetTransferSession, hashes: Any, region: Region, **kwargs: Any) -> Any:
        state = real(self, hashes, region, **kwargs)
        seen.append(Fetched(len(hashes), list(self.last_paths), dict(self.blocks_read), self.shared_with(region)))
        return state

    monkeypatch.setattr(FleetTransferSession, "fetch", fetch)
    return seen


def descriptors_done(fleet: Fleet) -> dict[str, int]:
    """Each live node's transfer descriptors done since it started (its counters: shm and stream reads alike)."""
    done = {}
    for node in fleet.live:
        with kvstore.Client(node.child.target) as direct:
            done[node.node_id] = direct.transfer_stats().descriptors_done
    return done


def stored_prompt(
    fleet: Fleet, tmp: Path, base: int, also: Callable[[Sequence[RunPlacement]], bool] | None = None
) -> tuple[list[int], list[bytes], Sequence[RunPlacement]]:
    """A prompt of BLOCKS blocks whose runs lie on every node (and whose loaded runs `also` accepts), stored through
    vLLM on the fleet: its tokens, its chain and the runs of the blocks a load reads (the last may be short)."""
    with fleet.client(geometry=GEO.name) as client:
        _, tokens = spread_prompt(
            fleet,
            lambda seed: prompt(BLOCKS * B + 4, seed=base + seed),
            client.hashes,
            also=None if also is None else lambda chain: also(client.placement(chain[:LOADED])),
        )
        chain = client.hashes(tokens)
        runs = client.placement(chain[:LOADED])
    store_through_vllm(fleet, tmp / "a", tokens)
    return tokens, chain, runs


def worker(engine: Engine) -> Any:
    """The engine's worker-side connector's worker (its loads' counters, its fleet client)."""
    return cast(Any, engine.worker).worker  # typed as vLLM's base class, which has none


def load(engine: Engine, tokens: list[int]) -> None:
    """The next turn of `tokens` through `engine`: a bounded replay whose usable tokens are loaded byte for byte."""
    turn2 = [*tokens, 3]
    engine.add("r2", turn2, max_tokens=2)
    so = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == USABLE
    assert_rows_loaded(engine, "r2", turn2, loaded_tokens=USABLE)
    assert worker(engine).loads.blocks_loaded == LOADED


def test_f63_vllm_shm_over_a_fleet_reads_this_hosts_nodes_runs_over_shared_memory(
    fleet: Fleet, tmp_path: Path, fetches: list[Fetched]
) -> None:
    """F63 through the connector: `path: shm` with the `data_dir` of this host's node (node 0): that node maps the
    load's region and copies in every run it holds over shared memory, the other runs streamed from their first
    replica (each node's transfer counters count what the session read from it); the rows loaded byte for byte."""
    local = fleet.nodes[0].node_id
    tokens, chain, runs = stored_prompt(
        fleet, tmp_path, 1100, also=lambda runs: 0 < sum(local in run.replicas for run in runs) < len(runs)
    )
    engine = Engine(tmp_path / "b", fleet_extra(fleet, path="shm", data_dir=str(fleet.data_dirs[local])))
    before = descriptors_done(fleet)
    load(engine, tokens)
    assert worker(engine).loads.load_paths == {"shm": 1}
    [got] = fetches
    assert got.blocks == LOADED and got.shared == [local]
    assert got.paths == ["shm" if local in run.replicas else "stream" for run in runs]
    mine = sum(run.end_block - run.first_block for run in runs if local in run.replicas)
    streamed: dict[tuple[str, str], int] = {}
    for run, first in zip(runs, first_reads(worker(engine).client, chain[:LOADED]), strict=True):
        if local not in run.replicas:
            streamed[first, "stream"] = streamed.get((first, "stream"), 0) + run.end_block - run.first_block
    assert got.read == {(local, "shm"): mine, **streamed}
    after = descriptors_done(fleet)  # each node served what the session says it read from it
    assert {n: after[n] - before[n] for n in after} == {
        n: sum(k for (m, _), k in got.read.items() if m == n) for n in after
    }
    engine.run()
    engine.close()


@pytest.mark.parametrize("path", ["auto", "shm"])
def test_f63_vllm_auto_or_shm_without_a_data_dir_maps_every_node_of_this_host(
    fleet: Fleet, tmp_path: Path, fetches: list[Fetched], path: str
) -> None:
    """F62, F63 through the connector: `path: auto` (no data_dir: no direct path) or `shm` over a fleet whose nodes
    all run on this host: every node maps the load's region and every run is copied in over shared memory by its
    first replica (each node's counters count what the session read from it), byte for byte."""
    tokens, _, runs = stored_prompt(fleet, tmp_path, 1200 if path == "auto" else 1300)
    engine = Engine(tmp_path / "b", fleet_extra(fleet, path=path))
    before = descriptors_done(fleet)
    load(engine, tokens)
    assert worker(engine).loads.load_paths == {"shm": 1}
    [got] = fetches
    assert got.blocks == LOADED and got.shared == sorted(n.node_id for n in fleet.nodes)
    assert got.paths == ["shm"] * len(runs)
    assert sum(got.read.values()) == LOADED and {p for _, p in got.read} == {"shm"}
    after = descriptors_done(fleet)
    assert {n: after[n] - before[n] for n in after} == {n: got.read.get((n, "shm"), 0) for n in after}
    engine.run()
    engine.close()


def test_f64_this_hosts_node_killed_mid_load_costs_vllm_nothing(
    fleet: Fleet, tmp_path: Path, fetches: list[Fetched], monkeypatch: pytest.MonkeyPatch
) -> None:
    """F64 through the connector (kills a node): `path: shm` with the data_dir of this host's node; the node is
    SIGKILLed in the middle of a load, once the load's region is mapped into it and before its runs are read (it
    stays in the view); the load still lands every row byte for byte, the node's runs streamed from their other
    replicas, and the session reports no block from it."""
    victim = fleet.nodes[2]
    tokens, _, runs = stored_prompt(
        fleet, tmp_path, 1400, also=lambda runs: any(victim.node_id in run.replicas for run in runs)
    )
    engine = Engine(tmp_path / "b", fleet_extra(fleet, path="shm", data_dir=str(fleet.data_dirs[victim.node_id])))
    mapped: list[list[str]] = []
    real = FleetTransferSession.register

    def register(self: FleetTransferSession, size_bytes: int) -> Region:
        region = real(self, size_bytes)
        mapped.append(self.shared_with(region))
        victim.child.kill9()  # mid-load: the region is mapped into it, none of its runs read yet
        return region

    monkeypatch.setattr(FleetTransferSession, "register", register)
    load(engine, tokens)
    assert mapped == [[victim.node_id]]
    [got] = fetches
    assert got.paths == ["stream"] * len(runs) and got.shared == []
    assert sum(got.read.values()) == LOADED and not any(n == victim.node_id for n, _ in got.read)
    assert worker(engine).loads.load_paths == {"grpc": 1}  # no run came over shared memory
    assert worker(engine).client.pool.failures[victim.node_id] >= 1
    engine.run()
    engine.close()
