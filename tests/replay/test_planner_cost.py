"""The cost model's per-call replay overhead (replay/cost.py) in the planner's choice (blocks of 16, V4.1-Flash)."""

from __future__ import annotations

import os

import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from replay.cost import DEFAULT_REPLAY_OVERHEAD_S, CostModel
from replay.plan import Action
from replay.planner import Planner


def test_the_replay_overhead_is_a_checked_setting() -> None:
    assert CostModel().replay_overhead_s == DEFAULT_REPLAY_OVERHEAD_S > 0
    assert CostModel(replay_overhead_s=0).replay_s(128) == CostModel().compute_s(128)
    assert CostModel(replay_overhead_s=0.5).replay_s(128) == pytest.approx(0.5 + CostModel().compute_s(128))
    for bad in (-0.001, float("nan"), float("inf"), True, "1"):
        with pytest.raises(InvalidArgument, match="replay_overhead_s"):
            CostModel(replay_overhead_s=bad)  # type: ignore[arg-type]


def test_the_replay_overhead_changes_the_choice_when_it_outweighs_the_saving(client: Client) -> None:
    """325 prompt tokens, 320 stored, no snapshot: a bounded replay recomputes 133 tokens (128 + 5) against
    325 for a full prefill. Without overhead the replay wins; a per-call overhead above the 192 tokens it
    saves (24 ms at 8,000 tokens/s) makes the full prefill the cheaper plan, and the plan says so."""
    tokens = list(range(1000, 1325))
    client.put(tokens[:320], [os.urandom(client.block_bytes) for _ in range(20)])
    fast_fetch = {"fetch_gbps": 1e3, "recompute_tokens_per_s": 8_000.0}
    with Planner(client, report=False) as planner:
        plan = planner.plan(tokens, cost=CostModel(replay_overhead_s=0.0, **fast_fetch))
        assert plan.action is Action.BOUNDED_REPLAY
        assert plan.estimated_s == pytest.approx(133 / 8_000 + 320 // 16 * client.block_bytes / 1e12)
        plan = planner.plan(tokens, cost=CostModel(replay_overhead_s=0.030, **fast_fetch))
        assert plan.action is Action.FULL_PREFILL
        assert any("30.000 ms per replay call" in r for r in plan.reasons)
