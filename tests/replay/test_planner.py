"""The resume planner against a real server (blocks of 16, V4.1-Flash: window 128, 40 layers):
each rule of docs/PLANNER.md with a test named after it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.swa_snapshot import snapshot_bytes
from replay.cost import CostModel
from replay.plan import Action
from replay.planner import Planner

W = V4_1_FLASH.window  # 128


def store(client: Client, tokens: Sequence[int], blocks: int, snapshots: Sequence[int] = (),
          extra_keys: Sequence[str] = ()) -> None:
    """The first `blocks` blocks of `tokens`, and a snapshot at each position."""
    b = client.block_tokens
    if blocks:
        client.put(tokens[: blocks * b], [os.urandom(client.block_bytes) for _ in range(blocks)],
                   extra_keys=extra_keys)
    for t in snapshots:
        client.swa.put(tokens, os.urandom(client.swa.snapshot_bytes(t)), position=t, extra_keys=extra_keys)


@pytest.fixture
def planner(client: Client) -> Iterator[Planner]:
    with Planner(client, report=False) as p:
        yield p


def prompt(blocks: int, extra: int, client: Client) -> list[int]:
    return list(range(1000, 1000 + blocks * client.block_tokens + extra))


def test_snapshot_keys_are_the_pools_keys_from_the_lookups_hashes(client: Client, planner: Planner) -> None:
    tokens = prompt(6, 3, client)
    hashes = client.hashes(tokens, extra_keys=["img"])
    positions, keys = planner._probes(hashes, len(hashes), ["img"])
    assert positions == [3 * 16, 4 * 16, 5 * 16, 6 * 16]
    assert keys == client.swa.keys(tokens, positions, extra_keys=["img"])


def test_plan_hashes_the_prompt_once(client: Client, planner: Planner, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.client.chain_memo as chain_memo
    import kvstore.client.connection as connection
    import kvstore.swa_snapshot as swa_snapshot

    calls: list[int] = []
    # Every way a chain is hashed: plainly, through the client's chain memo, for snapshot keys.
    for module, name in ((connection, "chain_hashes"), (chain_memo, "chain_hashes_of_bytes"),
                         (swa_snapshot, "chain_hashes")):
        real = getattr(module, name)

        def counted(*args: Any, real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    planner.plan(prompt(20, 5, client))
    assert len(calls) == 1


def test_fetch_snapshot_fetches_the_blocks_and_the_snapshot_and_keeps_the_lease(client: Client,
                                                                               planner: Planner) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20, [320], extra_keys=["img"])
    plan = planner.plan(tokens, extra_keys=["img"])
    assert plan.action is Action.FETCH_SNAPSHOT
    assert (plan.snapshot_position, plan.resume_tokens, plan.fetch_tokens, plan.prefill_tokens) == (320, 320, 320, 5)
    assert plan.fetch_bytes == 20 * client.block_bytes + snapshot_bytes(V4_1_FLASH, 320)
    assert plan.usable_tokens == plan.found_tokens == 320 and plan.replay_start is None
    assert plan.lease_id and client.stats().active_leases == 1
    assert len(plan.block_hashes) == 20
    assert any("snapshot at T=320 resumes at R=320" in r for r in plan.reasons)
    assert plan.reasons[-1].startswith("chose fetch+snapshot")


def test_resume_is_at_most_the_prompt_minus_one(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 0, client)
    store(client, tokens, 20, [320])
    plan = planner.plan(tokens)
    assert plan.action is Action.FETCH_SNAPSHOT
    assert (plan.snapshot_position, plan.resume_tokens, plan.prefill_tokens) == (320, 319, 1)


def test_a_snapshot_resume_fetches_only_the_blocks_below_it_rounded_up(client: Client) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20, [256])
    with Planner(client, snapshot_probes=8, report=False) as planner:
        plan = planner.plan(tokens)
    assert plan.action is Action.FETCH_SNAPSHOT and plan.found_tokens == 320
    assert (plan.resume_tokens, plan.fetch_tokens, plan.usable_tokens) == (256, 256, 256)
    assert plan.fetch_bytes == 16 * client.block_bytes + snapshot_bytes(V4_1_FLASH, 256)
    tokens = prompt(16, 0, client)  # R = T - 1 = 255: the block holding position 254 is fetched
    plan = Planner(client, report=False).plan(tokens)
    assert (plan.resume_tokens, plan.fetch_tokens) == (255, 256)


def test_bounded_replay_recomputes_one_window_before_the_hit(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20)
    plan = planner.plan(tokens)
    assert plan.action is Action.BOUNDED_REPLAY
    assert (plan.fetch_tokens, plan.replay_start, plan.resume_tokens, plan.prefill_tokens) == (320, 320 - W, 320, 5)
    assert plan.replay_tokens == W and plan.usable_tokens == 320 and plan.snapshot_position is None
    assert plan.fetch_bytes == 20 * client.block_bytes and plan.lease_id


def test_replay_length_is_the_tenants_fidelity_setting(client: Client) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20)
    with Planner(client, cost=CostModel(replay_windows=2), report=False) as planner:
        assert planner.plan(tokens).replay_start == 320 - 2 * W
        assert planner.plan(tokens, cost=CostModel(replay_windows=1)).replay_start == 320 - W  # per call


def test_a_replay_starting_at_or_below_zero_is_a_full_prefill(client: Client) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20)
    with Planner(client, cost=CostModel(replay_windows=4), report=False) as planner:  # would start at 320 - 512
        plan = planner.plan(tokens)
    assert plan.action is Action.FULL_PREFILL and plan.usable_tokens == 0 and plan.found_tokens == 320
    assert any("not feasible" in r for r in plan.reasons)


def test_exact_replay_when_the_tenant_asks_for_exact_only(start_server: Callable[..., Any],
                                                          store_settings: Any) -> None:
    server = start_server(store_settings)
    span = V4_1_FLASH.num_layers * W  # 5,120
    with Client(server.target, namespace="acme") as client:
        tokens = prompt(330, 3, client)
        store(client, tokens, 330)
        costs = {"acme": CostModel(replay_windows=None), "other": CostModel()}
        with Planner(client, tenant_costs=costs, report=False) as planner:
            plan = planner.plan(tokens)
            assert plan.action is Action.EXACT_REPLAY
            assert (plan.fetch_tokens, plan.replay_start, plan.usable_tokens) == (5280, 5280 - span, 5280)
            assert planner.plan(tokens[: 300 * 16 + 3]).action is Action.FULL_PREFILL  # 4,800 < 5,120
        with Planner(client, cost=CostModel(replay_windows=40), report=False) as planner:
            assert planner.plan(tokens).action is Action.EXACT_REPLAY  # 40 windows = layers x window


def test_a_hit_not_above_the_window_is_not_adopted(client: Client, planner: Planner) -> None:
    tokens = prompt(8, 5, client)
    store(client, tokens, 8)
    plan = planner.plan(tokens)
    assert plan.found_tokens == W and plan.action is Action.FULL_PREFILL and plan.usable_tokens == 0
    assert any("not adopted" in r for r in plan.reasons)


def test_a_snapshot_serves_a_hit_not_above_the_window(client: Client, planner: Planner) -> None:
    tokens = prompt(4, 5, client)
    store(client, tokens, 4, [64])
    plan = planner.plan(tokens)
    assert plan.action is Action.FETCH_SNAPSHOT and (plan.resume_tokens, plan.usable_tokens) == (64, 64)


def test_a_hit_reaching_the_prompt_end_replays_one_block_earlier(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 0, client)
    store(client, tokens, 20)
    plan = planner.plan(tokens)
    assert plan.action is Action.BOUNDED_REPLAY and plan.found_tokens == 320
    assert (plan.fetch_tokens, plan.resume_tokens, plan.prefill_tokens) == (304, 304, 16)


def test_a_full_prefill_releases_the_lease(client: Client) -> None:
    tokens = prompt(8, 5, client)
    store(client, tokens, 8)
    with Planner(client, report=False) as planner:
        plan = planner.plan(tokens)
        assert plan.action is Action.FULL_PREFILL and plan.lease_id is None
    assert client.stats().active_leases == 0
    assert any(r.startswith("lease released") for r in plan.reasons)


def test_nothing_found_is_a_full_prefill(client: Client, planner: Planner) -> None:
    plan = planner.plan(prompt(20, 5, client))
    assert plan.action is Action.FULL_PREFILL and plan.found_tokens == plan.usable_tokens == 0
    assert (plan.fetch_tokens, plan.resume_tokens, plan.prefill_tokens) == (0, 0, 325)
    assert planner.plan([7]).action is Action.FULL_PREFILL  # no block: no Lookup at all


def test_the_cost_model_chooses_recompute_when_fetching_is_slower(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20, [320])
    slow = CostModel(fetch_gbps=1e-6, recompute_tokens_per_s=1e6)
    plan = planner.plan(tokens, cost=slow)
    assert plan.action is Action.FULL_PREFILL and plan.estimated_s == pytest.approx(325 / 1e6)
    assert plan.reasons[-2].startswith("chose full-prefill") and "against fetch+snapshot" in plan.reasons[-2]
    # Fetching pays when recomputing is slow: the snapshot beats the replay (5 tokens against 133).
    assert planner.plan(tokens).action is Action.FETCH_SNAPSHOT


def test_a_snapshot_below_every_probe_is_found_by_a_second_lookup(client: Client) -> None:
    tokens = prompt(30, 5, client)
    store(client, tokens, 20, [320])
    with Planner(client, report=False) as planner:
        plan = planner.plan(tokens)
    assert plan.action is Action.FETCH_SNAPSHOT and plan.resume_tokens == 320
    assert client.stats().active_leases == 1  # the second Lookup takes no lease
    with Planner(client, report=False, reprobe=False) as planner:
        assert planner.plan(tokens).action is Action.BOUNDED_REPLAY


def test_every_plan_explains_itself(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20)
    reasons = planner.plan(tokens).reasons
    assert reasons[0].startswith("found 320 of 325 prompt tokens (20 blocks of 16)")
    assert reasons[1].startswith("snapshot: none serves")
    assert reasons[2].startswith("bounded replay (128 tokens, fidelity 1 x window): fetch 320 tokens")
    assert reasons[3].startswith("full prefill: compute 325 tokens")
    assert reasons[4].startswith("chose bounded-replay")


def test_plan_from_lookup_gives_the_same_plan_and_times_itself(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 5, client)
    store(client, tokens, 20)
    found = planner.lookup(tokens)
    plan = planner.plan_from_lookup(tokens, found)
    assert plan.action is Action.BOUNDED_REPLAY and plan.lease_id == found.lease_id
    assert plan.lookup_s == 0.0 and plan.plan_s > 0
    assert planner.plan(tokens).lookup_s > 0


def test_bad_prompts_raise_kvstore_errors(planner: Planner) -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        planner.plan([])
    with pytest.raises(InvalidArgument):
        planner.plan([-1] * 40)
    with pytest.raises(InvalidArgument, match="snapshot_probes"):
        Planner(planner.client, snapshot_probes=-1)


def test_one_token_left_to_prefill_is_one_token(client: Client, planner: Planner) -> None:
    tokens = prompt(20, 1, client)  # 321 tokens: the snapshot at 320 leaves one to compute
    store(client, tokens, 20, [320])
    reasons = planner.plan(tokens).reasons
    snapshot = next(r for r in reasons if r.startswith("snapshot at T=320"))
    assert "prefill 1 token = " in snapshot and not re.search(r"(?<![\d,])1 tokens", " ".join(reasons))
