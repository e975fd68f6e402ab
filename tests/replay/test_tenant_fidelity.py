"""A tenant's stored replay_fidelity reaches its planner (replay.planner.stored_fidelity, Planner's
fidelity_source; docs/PLANNER.md "The tenant's stored setting"): GetInfo answers the caller's tenant's
policy, another tenant's only to an admin; the planner reads it at construction and again after
fidelity_refresh_s, keeps the setting in use when a read fails. Real server on loopback, with auth."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.config import AuthSettings, StoreSettings
from kvstore.errors import InvalidArgument, PermissionDenied, Unavailable
from replay.fidelity_budget import DEFAULT_BUDGET
from replay.planner import Planner, stored_fidelity


@pytest.fixture
def authed(start_server: Callable[..., Any], store_settings: StoreSettings) -> tuple[Any, dict[str, str]]:
    """A server with tenants acme (read/write) and ops (admin); acme's policy says kl:1e-3."""
    path = store_settings.data_dir / "tenants.json"
    store_settings.data_dir.mkdir(parents=True, exist_ok=True)
    tokens = {"acme": api_tokens.create(path, "acme", frozenset({"read", "write"}))[1],
              "ops": api_tokens.create(path, "ops", frozenset({"read", "write", "admin"}))[1]}
    server = start_server(store_settings, auth=AuthSettings(reload_s=0.05))
    with AdminClient(server.target, token=tokens["ops"]) as admin:
        admin.set_policy("acme", replay_fidelity="kl:1e-3")
    return server, tokens


def test_getinfo_answers_the_callers_tenants_policy_and_another_only_to_an_admin(
        authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as acme:
        assert stored_fidelity(acme) == "kl:0.001"  # namespace '': the token's tenant
    with Client(server.target, token=tokens["ops"]) as ops:
        assert stored_fidelity(ops) == DEFAULT_BUDGET  # ops has no policy of its own: the default's
    with Client(server.target, token=tokens["ops"], namespace="acme") as ops_as_acme:
        assert stored_fidelity(ops_as_acme) == "kl:0.001"  # an admin may name another tenant
    with Client(server.target, token=tokens["acme"]) as acme:
        acme.namespace = "ops"  # as a client naming another tenant would send it (its constructor needs no call)
        with pytest.raises(PermissionDenied, match="namespace 'ops' is not this token's tenant"):
            stored_fidelity(acme)


def test_the_planner_follows_the_stored_setting_and_keeps_it_when_a_read_fails(
        authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as acme, AdminClient(server.target, token=tokens["ops"]) as admin:
        source = partial(stored_fidelity, acme)
        with Planner(acme, report=False, fidelity_source=source, fidelity_refresh_s=0) as planner:
            assert planner.stored_fidelity == "kl:0.001" and planner.span_choice is not None
            assert "the setting is the tenant's stored policy (replay_fidelity 'kl:0.001'" in planner.span_choice.reason
            admin.set_policy("acme", replay_fidelity="windows:3")
            planner.plan(list(range(1, 40)))  # a plan reads it again (refresh 0 s)
            assert planner.span_choice is not None and planner.span_choice.replay_windows == 3
            assert planner.cost.replay_windows == 3
        calls: list[str] = []

        def flaky() -> str:
            calls.append("read")
            if len(calls) > 1:
                raise Unavailable("the store is restarting")
            return "windows:2"

        with Planner(acme, report=False, fidelity_source=flaky, fidelity_refresh_s=0) as planner:
            plan = planner.plan(list(range(1, 40)))  # the read fails: the plan is made with windows:2
            assert len(calls) == 2 and planner.cost.replay_windows == 2 and "windows:2" in plan.reasons[1]
        reads: list[str] = []

        def counted() -> str:
            reads.append("read")
            return "windows:2"

        with Planner(acme, report=False, fidelity_source=counted, fidelity_refresh_s=3600) as planner:
            planner.plan(list(range(1, 40)))
            assert reads == ["read"]  # read once at construction, not again within the hour
        with Planner(acme, report=False, fidelity="windows:1", fidelity_source=lambda: "") as planner:
            assert planner.cost.replay_windows == 1  # a server keeping no policies: the fallback, said
            assert planner.span_choice is not None and "the server keeps no policy" in planner.span_choice.reason
        with Planner(acme, report=False, tenant_fidelity={"": "exact"}, fidelity_source=source) as planner:
            assert planner.stored_fidelity is None and planner.cost.replay_windows is None  # its own entry wins
        with pytest.raises(InvalidArgument, match="fidelity_refresh_s must be a number of seconds >= 0"):
            Planner(acme, report=False, fidelity_refresh_s=-1)
