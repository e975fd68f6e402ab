"""Resumer: plan, run on the worker, fall back cleanly (worker down, past its deadline, the store changed)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.worker import WorkerClient
from kvstore.errors import DeadlineExceeded, InvalidArgument, Unavailable
from kvstore.geometry import TINY

torch = pytest.importorskip("torch")

from replay.plan import Action, Plan  # noqa: E402
from replay.planner import Planner  # noqa: E402
from replay.resume import Resumer  # noqa: E402


def tokens_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


@pytest.fixture
def planner(store: Client) -> Iterator[Planner]:
    with Planner(store, report=False) as p:
        yield p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_turns_plan_run_and_hit_in_the_tenants_namespace(server: Any, workers: WorkerClient, model: Any) -> None:
    with Client(server.target, namespace="alice", geometry=TINY.name) as alice, \
            Planner(alice, report=False) as planner:
        resumer = Resumer(planner, workers)  # the worker client's own namespace is the worker's (default)
        first = resumer.resume(tokens_of(1, 41), max_new_tokens=10)
        assert first.ok and first.fallback is None and first.plan.action is Action.FULL_PREFILL
        assert first.run is not None
        prompt = tokens_of(1, 41) + list(first.run.output_tokens) + tokens_of(2, 13)
        second = resumer.resume(prompt)
    assert second.plan.action is Action.FETCH_SNAPSHOT and second.plan.snapshot_position == 48
    assert second.run is not None and second.run.snapshot_loaded
    assert torch.equal(second.run.logits, model.extend(model.new_state(), prompt)[-1])


def test_replay_then_full_hit(planner: Planner, workers: WorkerClient, store: Client) -> None:
    resumer = Resumer(planner, workers)
    prompt = tokens_of(3, 50)
    resumer.resume(prompt[:49])  # blocks to 48, snapshots at 48
    store.swa.delete_many(store.swa.keys(prompt, [32, 48]))
    replayed = resumer.resume(prompt)
    assert replayed.plan.action is Action.BOUNDED_REPLAY and replayed.run is not None
    assert replayed.run.tokens_replayed == TINY.window
    again = resumer.resume(prompt)  # the rebuilt snapshot at H was put back
    assert again.plan.action is Action.FETCH_SNAPSHOT and again.plan.snapshot_position == 48


def test_worker_down_falls_back_to_a_full_prefill(planner: Planner, store: Client) -> None:
    prompt = tokens_of(4, 40)
    with WorkerClient(f"127.0.0.1:{_free_port()}", timeout_s=10) as down:
        result = Resumer(planner, down).resume(prompt)
        assert result.run is None and isinstance(result.error, Unavailable)
        assert result.fallback is not None and result.fallback.action is Action.FULL_PREFILL
        assert result.fallback.prompt_tokens == 40 and result.fallback.fetch_tokens == 0
        assert result.reason and "down" in result.reason
        with pytest.raises(Unavailable) as caught:
            Resumer(planner, down, raise_on_fallback=True).resume(prompt)
        assert "full prefill" in caught.value.hint


def test_deadline_falls_back_and_releases_the_lease(planner: Planner, worker: Any, workers: WorkerClient,
                                                    store: Client) -> None:
    prompt = tokens_of(5, 40)
    Resumer(planner, workers).resume(prompt[:33])  # blocks 0-1 and a snapshot at 32: a leased fetch plan
    with worker.servicer.runner.device_lock:
        result = Resumer(planner, workers, timeout_s=0.5).resume(prompt)
    assert result.plan.action is Action.FETCH_SNAPSHOT and result.plan.lease_id
    assert isinstance(result.error, DeadlineExceeded) and result.fallback is not None
    assert result.fallback.action is Action.FULL_PREFILL and "deadline" in (result.reason or "")
    planner.close()  # waits for the background release
    assert store.stats().active_leases == 0


class VanishingPlanner(Planner):
    """A planner whose first plan's snapshot is dropped right after the plan (the store changed under it)."""

    plans = 0

    def plan(self, tokens: Any, **kw: Any) -> Plan:
        made = super().plan(tokens, **kw)
        self.plans += 1
        if self.plans == 1 and made.snapshot_position is not None:
            self.client.swa.delete_many(self.client.swa.keys(tokens, [made.snapshot_position]))
        return made


def test_a_vanished_snapshot_is_planned_again(store: Client, workers: WorkerClient) -> None:
    prompt = tokens_of(6, 50)
    Resumer(Planner(store, report=False), workers).resume(prompt[:49])
    with VanishingPlanner(store, report=False) as planner:
        result = Resumer(planner, workers).resume(prompt)
    assert planner.plans == 2 and result.replanned and result.ok
    assert result.plan.action is not Action.FETCH_SNAPSHOT or result.plan.snapshot_position != 48


def test_a_bad_request_raises(planner: Planner, workers: WorkerClient) -> None:
    with pytest.raises(InvalidArgument):
        Resumer(planner, workers).resume([1, 2, 999])


def test_what_was_done_is_reported_not_what_was_planned(store: Client, workers: WorkerClient) -> None:
    prompt = tokens_of(7, 40)
    with Planner(store) as planner:  # a reporting planner: the Resumer reports for it, after the run
        Resumer(planner, workers).resume(prompt)  # a full prefill, run
        Resumer(planner, workers).resume(prompt)  # a snapshot hit at 32, run
        with WorkerClient(f"127.0.0.1:{_free_port()}", timeout_s=10) as down:
            Resumer(planner, down).resume(prompt)  # a snapshot hit planned, fallen back: no hit
    stats = store.stats()
    assert (stats.resume_plans, stats.resume_fetch_snapshot_plans, stats.resume_full_prefill_plans) == (3, 1, 2)
    assert stats.resume_usable_tokens == 32


def test_the_requests_retention_hint_pins_its_prefix(server: Any, planner: Planner, workers: WorkerClient,
                                                     store: Client) -> None:
    from tiers.pins import PinLimits

    server.tier.set_pin_limits_provider(lambda ns: PinLimits(max_s=1e6, budget_bytes=1 << 30))
    until = server.tier.retention_clock.now() + 100 * 3600.0
    lookups = store.stats().lookups
    result = Resumer(planner, workers).resume(tokens_of(5, 41), keep_until_s=until)
    assert result.ok and (result.kept_until_s, result.keep_note) == (until, "")
    assert result.run is not None and result.run.kept_in_put and result.run.blocks_stored > 0
    assert store.stats().lookups == lookups + 1  # the plan's: the worker's Put pinned, no Lookup after it
    totals, live = server.tier.pins_of("default")
    assert totals.pins == 1 and live[0].key[-32:] == store.hashes(tokens_of(5, 41))[-1]  # the stored prefix's end
    # The same prompt again: all fetched, nothing to Put, so the pin (later) is a Lookup's, on the same block.
    later = until + 3600.0
    again = Resumer(planner, workers).resume(tokens_of(5, 41), keep_until_s=later)
    assert again.ok and again.run is not None and not again.run.kept_in_put and again.kept_until_s == later
    assert store.stats().lookups == lookups + 3  # two plans and the pin
    totals, live = server.tier.pins_of("default")
    assert totals.pins == 1 and live[0].until_s == later
    server.tier.set_pin_limits_provider(None)  # [store]'s limits: none, so a pin is refused, and said why
    refused = Resumer(planner, workers).resume(tokens_of(6, 41), keep_until_s=until)
    assert refused.ok and refused.kept_until_s == 0 and "may not pin" in refused.keep_note
