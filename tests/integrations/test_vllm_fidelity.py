"""The tenant's stored replay fidelity reaches the vLLM connector's planner (docs/ENGINES.md, "Replay
fidelity"): read at attach and again every `fidelity_refresh_s`, shown in the plan's reason line; the
engine's own setting wins. vLLM's real v1 Scheduler on CPU against a real `kvstore serve`, whose policy
is set through the Admin service (its own store: the policy it changes is no other module's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integrations.common import parse_settings
from kvstore.client.admin import AdminClient
from kvstore.errors import ConfigError
from tests.children import Child
from tests.integrations.test_vllm_support import GEO, Engine, extra, prompt, store_prompt


@pytest.fixture(scope="module")
def store(start_store: Callable[[], Child]) -> Child:
    return start_store()


@pytest.fixture
def admin(store: Child) -> Iterator[AdminClient]:
    with AdminClient(store.target) as a:
        yield a
        a.set_policy("default", replay_fidelity="fastllm:95")  # the default again for the next test


def test_the_tenants_stored_budget_reaches_the_plan_and_a_change_follows(store: Child, admin: AdminClient,
                                                                           tmp_path: Path) -> None:
    tokens = prompt(100, seed=40)
    store_prompt(store, tmp_path / "a", tokens)  # 96 tokens stored: 6 blocks of 16
    admin.set_policy("default", replay_fidelity="kl:1e-3")
    engine = Engine(tmp_path / "b", extra(store, tenant_fidelity=True, fidelity_refresh_s=0))
    engine.add("r2", tokens + prompt(50, seed=41), max_tokens=2)
    engine.step()
    plan = engine.connector.scheduler.plan_of("r2")
    # replay/fidelity/tiny.json: 1 window's KL bound (2.1e-2) misses 1e-3, 2 windows' (4.3e-4) meets it.
    assert plan.found_tokens == 96 and plan.replay_start == 96 - 2 * GEO.window
    assert plan.reasons[1].startswith("fidelity budget KL <= 0.001 nats per continued token (kl:0.001): 2 x window")
    assert "from replay/fidelity/tiny.json" in plan.reasons[1]
    assert "the tenant's stored policy (replay_fidelity 'kl:0.001', read again every 0 s)" in plan.reasons[1]
    admin.set_policy("default", replay_fidelity="windows:3")  # the operator changes it: the next plan follows
    engine.add("r3", tokens + prompt(40, seed=42), max_tokens=2)
    engine.step()
    plan = engine.connector.scheduler.plan_of("r3")
    assert plan.replay_start == 96 - 3 * GEO.window and "fidelity windows:3" in plan.reasons[1]
    engine.run()
    engine.close()


def test_the_engines_own_setting_wins_over_the_tenants(store: Child, admin: AdminClient, tmp_path: Path) -> None:
    tokens = prompt(100, seed=43)
    store_prompt(store, tmp_path / "a", tokens)
    admin.set_policy("default", replay_fidelity="windows:3")
    engine = Engine(tmp_path / "b", extra(store, replay_fidelity="windows:2"))
    engine.add("r2", tokens + prompt(30, seed=44), max_tokens=2)
    engine.step()
    plan = engine.connector.scheduler.plan_of("r2")
    assert plan.replay_start == 96 - 2 * GEO.window
    assert plan.reasons[1].startswith("fidelity windows:2") and "stored policy" not in plan.reasons[1]
    engine.run()
    engine.close()


def test_fidelity_settings_are_checked() -> None:
    base = {"target": "127.0.0.1:1"}
    assert parse_settings(base).fidelity is None  # neither: the tenant's stored policy
    assert parse_settings({**base, "replay_windows": 2}).fidelity == "windows:2"
    assert parse_settings({**base, "replay_windows": "exact"}).fidelity == "exact"
    assert parse_settings({**base, "replay_fidelity": " KL:1e-3"}).fidelity == "kl:0.001"
    assert parse_settings({**base, "fidelity_refresh_s": 5}).fidelity_refresh_s == 5.0
    with pytest.raises(ConfigError, match="sets both 'replay_windows' and 'replay_fidelity'"):
        parse_settings({**base, "replay_windows": 1, "replay_fidelity": "exact"})
    with pytest.raises(ConfigError, match="'replay_fidelity': replay fidelity 'tight' is not a setting"):
        parse_settings({**base, "replay_fidelity": "tight"})
    with pytest.raises(ConfigError, match="'fidelity_refresh_s' must be a number >= 0"):
        parse_settings({**base, "fidelity_refresh_s": -1})
