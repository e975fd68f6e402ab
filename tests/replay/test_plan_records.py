"""The plan's records and the cost model (no server), and the planner's torch-free import path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.errors import InvalidArgument
from replay.cost import CostModel, parse_replay_windows
from replay.plan import Action, Plan


def replay_plan() -> Plan:
    return Plan(prompt_tokens=325, action=Action.BOUNDED_REPLAY, fetch_tokens=320, fetch_bytes=284_800,
                snapshot_position=None, resume_tokens=320, replay_start=192, prefill_tokens=5, usable_tokens=320,
                found_tokens=320, lease_id="abc", block_hashes=[b"\0" * 32] * 20, estimated_s=0.0133,
                reasons=["found 320 of 325"])


def test_the_planner_modules_do_not_import_torch() -> None:
    code = ("import sys, replay.planner, replay.plan, replay.cost, replay.plan_command; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_plan_to_dict_is_json_without_the_hashes() -> None:
    data = json.loads(json.dumps(replay_plan().to_dict()))
    assert data["action"] == "bounded-replay" and data["replay_tokens"] == 128 and "block_hashes" not in data
    assert data["lease_id"] == "abc" and data["reasons"] == ["found 320 of 325"]
    assert "block_hashes" not in repr(replay_plan())


def test_a_fallback_is_a_full_prefill_that_says_why() -> None:
    plan = replay_plan().fallback("worker unavailable")
    assert plan.action is Action.FULL_PREFILL and plan.usable_tokens == plan.fetch_tokens == plan.resume_tokens == 0
    assert plan.prefill_tokens == 325 and plan.replay_start is None and plan.found_tokens == 320
    assert plan.reasons[-1] == "fallback to a full prefill: worker unavailable"
    assert plan.replay_tokens == 0


def test_summary_names_the_action_and_its_numbers() -> None:
    assert replay_plan().summary() == ("bounded-replay, fetch 320 tokens (284,800 B), replay [192, 320), resume at "
                                       "320, prefill 5, usable 320 of 325, estimated 13.300 ms")


def test_cost_model_rates_and_replay_lengths() -> None:
    cost = CostModel(fetch_gbps=2.0, recompute_tokens_per_s=1000.0)
    assert cost.fetch_s(4_000_000_000) == 2.0 and cost.compute_s(500) == 0.5
    assert cost.replay_tokens(window=128, num_layers=40) == (128, False)
    assert CostModel(replay_windows=4).replay_tokens(window=128, num_layers=40) == (512, False)
    assert CostModel(replay_windows=None).replay_tokens(window=128, num_layers=40) == (5120, True)
    assert CostModel(replay_windows=5).replay_tokens(window=8, num_layers=5) == (40, True)
    assert CostModel(replay_windows=9).replay_tokens(window=8, num_layers=5) == (40, True)
    assert (CostModel().fidelity, CostModel(replay_windows=None).fidelity) == ("1 x window", "exact")


@pytest.mark.parametrize("kwargs", [{"fetch_gbps": 0}, {"fetch_gbps": float("inf")}, {"fetch_gbps": "6"},
                                    {"recompute_tokens_per_s": -1.0}, {"recompute_tokens_per_s": True},
                                    {"replay_windows": 0}, {"replay_windows": 1.5}, {"replay_windows": True}])
def test_cost_model_refuses_bad_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        CostModel(**kwargs)  # type: ignore[arg-type]


def test_parse_replay_windows() -> None:
    assert (parse_replay_windows("2"), parse_replay_windows("Exact")) == (2, None)
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(InvalidArgument, match="positive integer or 'exact'"):
            parse_replay_windows(bad)
