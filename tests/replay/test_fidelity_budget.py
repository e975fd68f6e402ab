"""Fidelity budgets (replay/fidelity_budget.py, docs/PLANNER.md "Fidelity budgets"): the span the planner
picks is held to a table with known bounds; the plan's reason line; the tenant's policy field through a
real server and `kvstore policy`; the interval statistics (replay/fidelity_stats.py)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH
from replay.fidelity_budget import (
    DEFAULT_BUDGET,
    FidelityBudget,
    FidelityTable,
    choose_span,
    parse_budget,
)
from replay.fidelity_stats import bootstrap, interval
from replay.plan import Action
from replay.planner import Planner

W = V4_1_FLASH.window


def fig(mean: float, high: float, worst: float, resumes: int = 120) -> dict[str, Any]:
    return {"mean": mean, "ci_low": mean / 2, "ci_high": high, "worst": worst, "resumes": resumes,
            "seeds": {"training": ["a", "b"], "prompt": [1, 2, 3]}}


def case(kl_high: float, pass_worst: float, pass_mean: float = 1.0) -> dict[str, Any]:
    return {"kl_per_token": fig(kl_high / 2, kl_high, kl_high * 10), "fastllm_pass": fig(pass_mean, 1.0, pass_worst)}


#: Bounds by span: 1 window: KL <= 1e-3 (random), 2e-3 (block boundary), pass worst 0.8 (mean 0.96);
#: 2 windows: KL 1e-4, pass worst 0.97; 4 windows: KL 1e-8, pass worst 1.
TABLE = FidelityTable.from_dict({
    "format": 1, "model": "test", "window": 8, "prompt_seeds": [1, 2, 3], "training": ["a", "b"],
    "spans": {"1": {"random": case(1e-3, 0.9, 0.99), "block boundary": case(2e-3, 0.8, 0.96)},
              "2": {"random": case(5e-5, 1.0), "block boundary": case(1e-4, 0.97)},
              "4": {"random": case(1e-9, 1.0), "block boundary": case(1e-8, 1.0)}}}, source="test.json")


def windows(text: str) -> int | None:
    return choose_span(parse_budget(text), TABLE).replay_windows


def test_a_budget_between_two_spans_bounds_picks_the_larger() -> None:
    assert windows("kl:5e-4") == 2  # 1 window's 2e-3 misses it, 2 windows' 1e-4 meets it
    assert windows("kl:1e-6") == 4
    assert windows("kl:1e-4") == 2  # a bound equal to the budget meets it
    assert windows("kl:0.01") == 1


def test_the_bound_is_the_worst_case_of_the_table() -> None:
    # 1 window's "random" bound (1e-3) meets 1.5e-3, its "block boundary" bound (2e-3) does not.
    assert windows("kl:1.5e-3") == 2


def test_a_kl_budget_is_held_to_the_upper_end_of_the_interval() -> None:
    # 1 window's mean KL (1e-3 in block boundary) meets 1.2e-3; its upper end, 2e-3, does not.
    assert windows("kl:1.2e-3") == 2


def test_a_pass_rate_budget_is_held_to_the_worst_seed_group() -> None:
    # 1 window passes on 96-99% of resumes on average, but its worst group passes 80%: 90% needs 2 windows.
    assert windows("fastllm:90") == 2
    assert windows("fastllm:80") == 1
    assert windows("fastllm:99%") == 4  # 2 windows' worst group passes 97%


def test_a_budget_no_span_meets_gives_exact_replay_and_says_so() -> None:
    choice = choose_span(parse_budget("kl:1e-12"), TABLE)
    assert choice.replay_windows is None
    assert "exact replay: no measured span meets it" in choice.reason and "4 x window" in choice.reason
    no_table = choose_span(parse_budget("kl:1e-3"), None)
    assert no_table.replay_windows is None and "no fidelity table" in no_table.reason


def test_exact_and_windows_need_no_table() -> None:
    assert choose_span(parse_budget("exact"), None).replay_windows is None
    assert choose_span(parse_budget("windows:3"), None).replay_windows == 3


def test_the_reason_line_says_which_span_why_and_the_expected_error() -> None:
    reason = choose_span(parse_budget("kl:5e-4"), TABLE).reason
    assert reason.startswith("fidelity budget KL <= 0.0005 nats per continued token (kl:0.0005): 2 x window")
    assert "smallest span whose measured bound meets it" in reason
    assert "expected kl_per_token ci_high 0.0001 nats (worst case 'block boundary'" in reason
    assert "smaller spans miss it: 1 x window 0.002 nats ('block boundary')" in reason
    assert "test.json" in reason and "prompt seeds [1, 2, 3], 2 training seed(s)" in reason


@pytest.mark.parametrize(("text", "message"), [
    ("kl:-1", "a KL budget is nats per continued token in (0, 10]"),
    ("kl:0", "a KL budget is nats per continued token"),
    ("kl:nan", "a KL budget"),
    ("fastllm:101", "a pass-rate budget is a percent of resumes in (0, 100]"),
    ("windows:0", "a span is a whole number of windows >= 1"),
    ("windows:1.5", "a span is a whole number of windows"),
    ("kl:abc", "'abc' is not a number"),
    ("fast:9", "is not a setting: give 'exact', 'windows:N'"),
    ("", "is not a setting"),
])
def test_bad_budgets_are_refused_with_what_each_form_takes(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        parse_budget(text)


def test_budget_text_reads_back() -> None:
    for text in ("exact", "windows:2", "kl:0.001", "fastllm:99", DEFAULT_BUDGET):
        assert parse_budget(parse_budget(text).text) == parse_budget(text)
    assert parse_budget(" KL:1e-3 ") == FidelityBudget("kl", 1e-3)


def test_a_damaged_table_is_refused() -> None:
    with pytest.raises(ValueError, match="not format 1"):
        FidelityTable.from_dict({"format": 2, "spans": {}})
    with pytest.raises(ValueError, match=r"lacks kl_per_token\.ci_high"):
        FidelityTable.from_dict({"format": 1, "spans": {"1": {"random": {"fastllm_pass": fig(1, 1, 1)}}}})


def test_the_shipped_table_loads_and_resolves_the_default_budget() -> None:
    table = FidelityTable.shipped("tiny")
    assert table.model == "tiny" and table.spans and len(table.meta["prompt_seeds"]) >= 3
    choice = choose_span(parse_budget(DEFAULT_BUDGET), table)
    assert DEFAULT_BUDGET in choice.reason


# -- the planner against a real server (blocks of 16, V4.1-Flash: window 128) --------------------------


def stored_prompt(client: Client, blocks: int, extra: int) -> list[int]:
    b = client.block_tokens
    tokens = list(range(1, blocks * b + extra + 1))
    client.put(tokens[: blocks * b], [os.urandom(client.block_bytes) for _ in range(blocks)])
    return tokens


def test_the_planner_replays_the_span_the_budget_chose_and_says_why(client: Client) -> None:
    tokens = stored_prompt(client, 40, 20)  # H = 640 > 2W
    with Planner(client, report=False, fidelity="kl:5e-4", fidelity_table=TABLE) as planner:
        plan = planner.plan(tokens)
    assert plan.action is Action.BOUNDED_REPLAY
    assert plan.replay_start == 640 - 2 * W
    assert plan.reasons[1].startswith("fidelity budget KL <= 0.0005 nats per continued token (kl:0.0005): 2 x window")
    assert any("bounded replay (256 tokens, fidelity 2 x window)" in r for r in plan.reasons)
    # The tenant's own setting wins over the planner's; one no span meets replays exactly (infeasible here).
    with Planner(client, report=False, fidelity="kl:5e-4", tenant_fidelity={client.namespace: "kl:1e-12"},
                 fidelity_table=TABLE) as planner:
        plan = planner.plan(tokens)
    assert "exact replay: no measured span meets it" in plan.reasons[1]
    assert plan.action is not Action.BOUNDED_REPLAY
    with Planner(client, report=False) as planner:  # no fidelity setting: the cost model's span, no budget line
        plan = planner.plan(tokens)
    assert plan.replay_start == 640 - W and not any("fidelity budget" in r for r in plan.reasons)


def test_a_bad_budget_given_to_the_planner_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="is not a setting"):
        Planner(client, report=False, fidelity="tight")


# -- the tenant's policy field through a real server ------------------------------------------------------


def test_policy_set_and_get_a_budget_through_the_server(server: Any) -> None:
    with AdminClient(server.target) as admin:
        assert admin.get_policy("acme").policy.policy.replay_fidelity == DEFAULT_BUDGET
        reply = admin.set_policy("acme", replay_fidelity=" KL:1e-3")
        assert reply.before.policy.replay_fidelity == DEFAULT_BUDGET
        assert reply.after.policy.replay_fidelity == "kl:0.001"  # stored canonical
        assert admin.get_policy("acme").policy.policy.replay_fidelity == "kl:0.001"
        assert admin.set_policy("acme", replay_fidelity="exact").after.policy.replay_fidelity == "exact"
        for bad, message in (("kl:-1", "a KL budget is nats per continued token"),
                             ("tight", "is not a setting")):
            with pytest.raises(InvalidArgument, match=message) as raised:
                admin.set_policy("acme", replay_fidelity=bad)
            assert "replay_fidelity for tenant 'acme'" in str(raised.value)
        assert admin.get_policy("acme").policy.policy.replay_fidelity == "exact"  # the refused changes changed nothing
        [entry] = [e for e in admin.policy_log(tenant="acme") if "kl:0.001" in e.new_json]
        assert json.loads(entry.new_json) == {"replay_fidelity": "kl:0.001"}


def test_kvstore_policy_set_replay_fidelity(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore import cli as kvcli

    code = kvcli.main(["policy", "set", "acme", "--replay-fidelity", "fastllm:99", "--target", server.target])
    out, _ = capsys.readouterr()
    assert code == 0 and f"replay_fidelity    {DEFAULT_BUDGET} -> fastllm:99" in out
    code = kvcli.main(["policy", "list", "--target", server.target])
    out, _ = capsys.readouterr()
    assert code == 0 and "fastllm:99" in out.splitlines()[2]
    code = kvcli.main(["policy", "set", "acme", "--replay-fidelity", "fastllm:0", "--target", server.target])
    _, err = capsys.readouterr()
    assert code == 2 and "InvalidArgument" in err and "a pass-rate budget is a percent of resumes" in err


def test_a_damaged_stored_budget_is_refused_at_start() -> None:
    from gateway.policies import parse_fields

    assert parse_fields("acme", {"replay_fidelity": "KL:1e-3"}) == {"replay_fidelity": "kl:0.001"}
    with pytest.raises(ValueError, match="tenant 'acme': replay_fidelity is 'loose'"):
        parse_fields("acme", {"replay_fidelity": "loose"})


# -- the interval statistics ---------------------------------------------------------------------------------


def test_bootstrap_interval_holds_the_mean_and_narrows_with_resumes() -> None:
    assert bootstrap([0.25] * 10) == (0.25, 0.25, 0.25)
    assert bootstrap([]) == (0.0, 0.0, 0.0)
    few = bootstrap([0.0, 1.0] * 5)
    many = bootstrap([0.0, 1.0] * 500)
    assert few[1] < 0.5 < few[2] and few[0] == many[0] == 0.5
    assert many[2] - many[1] < (few[2] - few[1]) / 5  # ~sqrt(100) narrower
    assert bootstrap([0.0, 1.0] * 5, seed=3) == bootstrap([0.0, 1.0] * 5, seed=3)  # a table regenerates the same


def test_interval_worst_is_the_worst_resume_or_the_worst_seed_group() -> None:
    groups = [("a", 1)] * 4 + [("b", 1)] * 4
    kl = interval("kl_per_token", [1e-4, 2e-4, 5e-3, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4], groups)
    assert kl["worst"] == 5e-3 and kl["resumes"] == 8
    assert kl["ci_low"] <= kl["mean"] <= kl["ci_high"]
    assert kl["seeds"] == {"training": ["a", "b"], "prompt": [1]}
    top1 = interval("top1_agreement", [1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], groups)
    assert top1["worst"] == 0.5
    passed = interval("fastllm_pass", [1, 1, 1, 1, 1, 0, 0, 1], groups)
    assert passed["worst"] == 0.5 and passed["mean"] == 0.75  # group b passes 2 of 4
    with pytest.raises(ValueError, match="unknown fidelity figure"):
        interval("cosine", [1.0], [("a", 1)])


def test_kvstore_plan_with_a_fidelity_budget(server: Any, client: Client, tmp_path: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main

    tokens = stored_prompt(client, 40, 20)
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(tokens))
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": 1, "model": "test", "prompt_seeds": [1, 2, 3], "training": ["a", "b"],
                                 "spans": {str(k): v for k, v in TABLE.spans.items()}}))
    args = ["plan", "--tokens", str(prompt), "--target", server.target, "--json", "--fidelity-table", str(table)]
    assert main([*args, "--fidelity", "kl:5e-4"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["replay_start"] == 640 - 2 * W and "2 x window, the smallest span" in plan["reasons"][1]
    assert main([*args, "--fidelity", "kl:5"]) == 0  # every span meets it: the smallest, 1 window
    assert json.loads(capsys.readouterr().out)["replay_start"] == 640 - W
    assert main([*args, "--fidelity", "kl:-5"]) == 2  # --json: the error as JSON on stdout
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and "a KL budget is nats per continued token" in error["message"]
