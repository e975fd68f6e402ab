"""The simulation: kvstore's own hashes, the tier's Put, eviction and retention rules, the planner, on
virtual time, over small slices of the shipped traces (tests/fixtures/traces/)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes
from kvstore.swa_snapshot import snapshot_bytes
from kvstore.trace.chains import ChainKeys
from kvstore.trace.load import load_trace
from kvstore.trace.requests import Trace
from kvstore.trace.simulate import SimSettings, Simulation
from kvstore.trace.tokens import prompt_tokens

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
BLOCK = V4_1_FLASH.block_bytes(64)


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load_trace(FIXTURES / "mooncake.jsonl")


@pytest.fixture(scope="module")
def weka() -> Trace:
    return load_trace(FIXTURES / "weka_session.json")


@pytest.mark.parametrize("name", ["mooncake", "weka"])
def test_chain_keys_are_kvstores_own_hashes_of_the_mapped_prompt(name: str, request: pytest.FixtureRequest) -> None:
    trace: Trace = request.getfixturevalue(name)
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    chains = ChainKeys(scope, 64)
    for r in trace.requests:  # in arrival order: the session's previous prompt and the memo are used
        want = [scope.key(h) for h in chain_hashes(list(prompt_tokens(r)), block_tokens=64, parent=chains.root)]
        assert chains.keys(r) == want


def _found_without_eviction(trace: Trace) -> int:
    """Found tokens when every earlier prompt's blocks stay: the longest stored prefix, by a plain set."""
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    chains, stored, found = ChainKeys(scope, 64), set(), 0
    for r in trace.requests:
        keys = chains.keys(r)
        hit = next((i for i, k in enumerate(keys) if k not in stored), len(keys))
        found += hit * 64
        stored.update(keys)
    return found


def test_unlimited_store_finds_every_earlier_prefix(mooncake: Trace) -> None:
    result = Simulation(SimSettings()).run(mooncake)
    assert result.total.found_tokens == _found_without_eviction(mooncake) > 0
    assert result.total.evicted_blocks == result.total.refused_puts == 0
    assert result.total.requests == len(mooncake.requests)
    distinct = len({k for r in mooncake.requests for k in ChainKeys(
        BlockScope(V4_1_FLASH.fingerprint, "default"), 64).keys(r)})
    assert result.peak_stored_bytes == result.node_bytes["node-0"] == distinct * BLOCK


def test_a_full_store_refuses_puts_within_retention_and_evicts_past_it(mooncake: Trace) -> None:
    capacity = 200 * BLOCK
    kept = Simulation(SimSettings(capacity_bytes=capacity)).run(mooncake)  # a 1-hour slice, 72 h retention
    assert kept.total.evicted_blocks == 0 and kept.total.refused_puts > 0  # R4: nothing within retention goes
    assert kept.node_bytes["node-0"] <= capacity
    # two minutes apart, past R4's extra minute (TOUCH_GRANULARITY_S), with no retention beyond it
    apart = Trace(name="apart", kind="mooncake",
                  requests=[replace(r, arrival_s=120.0 * i) for i, r in enumerate(mooncake.requests)])
    sim = Simulation(SimSettings(capacity_bytes=capacity, retention_hours=0))
    evicting = sim.run(apart)
    assert evicting.total.evicted_blocks > 0 and evicting.node_bytes["node-0"] <= capacity
    index = sim.nodes["node-0"].index
    assert index.usage.blocks == len(index.blocks) and index.usage.stored_bytes == len(index.blocks) * BLOCK
    for key, block in index.records():  # R6: no stored block lost its parent
        assert block.parent is None or block.parent in index.blocks, key.hex()
    # R7, least recently used first: the one block every prompt shares is used by each, so it stays
    assert evicting.total.found_tokens == _found_without_eviction(mooncake)


def test_a_refused_put_leaves_the_index_as_it_was(mooncake: Trace) -> None:
    # A at 0 s, B at 100 s evicts A's tail; C at 110 s could evict the rest of A (past R4) but not B
    # (within its minute): the Put is refused after evicting some, and those evictions are undone.
    a, b, c = (replace(r, arrival_s=t) for r, t in zip(mooncake.requests[:3], (0.0, 100.0, 110.0), strict=True))
    sim = Simulation(SimSettings(capacity_bytes=150 * BLOCK, retention_hours=0, swa_ttl_s=0))
    tally = sim.run(Trace(name="ab", kind="mooncake", requests=[a, b])).total
    assert tally.evicted_blocks > 0 and tally.refused_puts == 0
    index = sim.nodes["node-0"].index
    before = ({k: (v.last_access_s, sorted(v.children or ())) for k, v in index.records()},
              list(index.synced_lru()), index.usage.stored_bytes)
    keys, numbers = sim._chains.keys_and_ids(c)
    sim.step(c, keys, tally, numbers)
    assert tally.refused_puts == 1
    after = ({k: (v.last_access_s, sorted(v.children or ())) for k, v in index.records()},
             list(index.synced_lru()), index.usage.stored_bytes)
    assert after == before


def test_snapshots_live_for_the_ttl_and_turn_replays_into_exact_resumes(weka: Trace) -> None:
    none = Simulation(SimSettings(swa_ttl_s=0)).run(weka)
    live = Simulation(SimSettings(swa_ttl_s=3600)).run(weka)
    short = Simulation(SimSettings(swa_ttl_s=1)).run(weka)  # gaps between turns are seconds or more
    assert none.total.snapshot_resumes == short.total.snapshot_resumes == 0 and none.peak_swa_bytes == 0
    assert live.total.snapshot_resumes > 0 and live.total.replay_resumes < none.total.replay_resumes
    assert live.total.found_tokens == none.total.found_tokens  # the TTL changes what is usable, not found
    assert live.total.replay_tokens < none.total.replay_tokens
    # every prompt's snapshot is still live at the end of this 5-minute slice: DRAM is their sum
    ends = {len(ChainKeys(BlockScope(V4_1_FLASH.fingerprint, "default"), 64).keys(r)) * 64 for r in weka.requests}
    assert live.peak_swa_bytes == sum(snapshot_bytes(V4_1_FLASH, p) for p in ends)


def test_placement_over_nodes_keeps_hits_and_spreads_bytes(mooncake: Trace) -> None:
    one = Simulation(SimSettings()).run(mooncake)
    three = Simulation(SimSettings(nodes=3, replication=2, run_blocks=4)).run(mooncake)
    assert three.total.found_tokens == one.total.found_tokens
    assert sum(three.node_bytes.values()) == 2 * one.node_bytes["node-0"]
    assert all(b > 0 for b in three.node_bytes.values())
    assert sum(three.node_reads.values()) == sum(one.node_reads.values())
