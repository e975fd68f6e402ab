"""A Run of each plan kind through a real worker and a real store: what it computes, fetches and stores."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.worker import WorkerClient
from kvstore.errors import FailedPrecondition
from kvstore.geometry import TINY

torch = pytest.importorskip("torch")

from replay.model.cache_io import restore_state, state_blocks  # noqa: E402

B = 16  # the test store's block_tokens


def tokens_of(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny vocabulary, fixed by the seed."""
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


def plan(action: str, *, fetch: int = 0, position: int | None = None, resume: int = 0,
         replay_start: int | None = None, lease_id: str | None = None) -> SimpleNamespace:
    """A plan with the fields the worker reads (replay.plan.Plan has them too)."""
    return SimpleNamespace(action=action, fetch_tokens=fetch, snapshot_position=position, resume_tokens=resume,
                           replay_start=replay_start, lease_id=lease_id)


def from_scratch(model: Any, tokens: list[int]) -> Any:
    return model.extend(model.new_state(), tokens)[-1]


def test_full_prefill_stores_blocks_and_snapshots_at_the_prompt_and_output_ends(
        workers: WorkerClient, store: Client, model: Any) -> None:
    prompt = tokens_of(1, 41)
    run = workers.run(prompt, None, max_new_tokens=10)
    assert torch.equal(run.logits, from_scratch(model, prompt))
    assert len(run.output_tokens) == 10
    history = prompt + run.output_tokens  # 51 tokens: 3 full blocks
    assert run.blocks_stored == 3 and run.blocks_fetched == 0
    assert run.snapshot_positions == [32, 48]  # block boundaries at or below the prompt end and the output end
    assert run.tokens_computed == 51
    assert store.lookup(history).found_tokens == 48
    assert store.lookup(history, swa_positions=[32]).swa_position == 32
    assert store.lookup(history, swa_positions=[48]).swa_position == 48
    # The stored bytes are the model's: a from-scratch state gives the same blocks.
    state = model.new_state()
    model.extend(state, history)
    got = store.get(history)
    assert [bytes(b) for b in state_blocks(TINY, state, B)] == got.blocks


def test_output_tokens_are_greedy(workers: WorkerClient, model: Any) -> None:
    prompt = tokens_of(2, 20)
    run = workers.run(prompt, None, max_new_tokens=5, store=False)
    state = model.new_state()
    logits = model.extend(state, prompt)[-1]
    expected, _ = model.greedy(state, logits, 5)
    assert run.output_tokens == list(expected)
    assert run.snapshot_positions == [] and run.blocks_stored == 0


def test_snapshot_every_n_tokens(workers: WorkerClient) -> None:
    run = workers.run(tokens_of(3, 70), None, snapshot_every=32)
    assert run.snapshot_positions == [32, 64]


def test_fetch_snapshot_resumes_bit_identical(workers: WorkerClient, store: Client, model: Any) -> None:
    first = workers.run(tokens_of(4, 41), None, max_new_tokens=10)
    prompt = tokens_of(4, 41) + first.output_tokens + tokens_of(5, 13)
    run = workers.run(prompt, plan("fetch+snapshot", fetch=48, position=48, resume=48))
    assert run.snapshot_loaded and run.blocks_fetched == 3 and run.resume_tokens == 48
    assert run.tokens_computed == len(prompt) - 48
    assert torch.equal(run.logits, from_scratch(model, prompt))
    assert run.blocks_stored == 1  # block 3 only: blocks 0-2 were fetched
    assert store.lookup(prompt).found_tokens == 64


def test_resume_at_t_minus_1_from_an_even_snapshot(workers: WorkerClient, model: Any) -> None:
    first = workers.run(tokens_of(6, 40), None)  # snapshot at 32
    assert first.snapshot_positions == [32]
    prompt = tokens_of(6, 40) + tokens_of(7, 5)
    run = workers.run(prompt, plan("fetch+snapshot", fetch=32, position=32, resume=31), store=False)
    assert torch.equal(run.logits, from_scratch(model, prompt))


def _replayed(model: Any, tokens: list[int], fetch: int, start: int) -> Any:
    exact = model.new_state()
    model.extend(exact, tokens[:fetch])
    rows = restore_state(TINY, state_blocks(TINY, exact, B), None, position=fetch, resume=fetch, device="cpu")
    state = model.replay(tokens, rows, span=fetch - start)
    return model.extend(state, tokens[fetch:])[-1]


def test_bounded_replay_puts_the_rebuilt_snapshot_back(workers: WorkerClient, store: Client, model: Any) -> None:
    prompt = tokens_of(8, 45)
    workers.run(prompt[:33], None, store=True)  # blocks 0-1; its snapshot at 32 is dropped below
    store.swa.delete_many(store.swa.keys(prompt, [32]))
    assert store.lookup(prompt, swa_positions=[32]).swa_position is None
    run = workers.run(prompt, plan("bounded-replay", fetch=32, resume=32, replay_start=24))
    assert run.tokens_replayed == 8 and run.blocks_fetched == 2 and not run.snapshot_loaded
    assert torch.equal(run.logits, _replayed(model, prompt, 32, 24))
    assert 32 in run.snapshot_positions
    assert store.lookup(prompt, swa_positions=[32]).swa_position == 32  # the next turn is a full hit


def test_exact_replay_matches_from_scratch(workers: WorkerClient, store: Client, model: Any) -> None:
    prompt = tokens_of(9, 60)
    workers.run(prompt[:49], None, store=True)
    start = 48 - TINY.num_layers * TINY.window  # layers x window before H
    run = workers.run(prompt, plan("exact-replay", fetch=48, resume=48, replay_start=start), store=False)
    assert run.tokens_replayed == 48 - start
    assert torch.equal(run.logits, _replayed(model, prompt, 48, start))
    assert torch.equal(run.logits, from_scratch(model, prompt))  # layers x window: the window state is exact


def test_tail_prefill_reaches_the_model(workers: WorkerClient, model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # On this architecture the last position's logits are the same either way (the layers after the
    # last kv source need only the last window), so the switch is observed where the model gets it.
    asked: list[Any] = []
    extend = model.extend

    def spy(state: Any, tokens: Any, **kw: Any) -> Any:
        asked.append(kw.get("tail_prefill"))
        return extend(state, tokens, **kw)

    monkeypatch.setattr(model, "extend", spy)
    prompt = tokens_of(10, 40)
    run = workers.run(prompt, None, tail_prefill=True, store=False, max_new_tokens=1)
    assert asked == [True, False]  # the prompt with it, the decoded token without
    assert torch.equal(run.logits, extend(model.new_state(), prompt, tail_prefill=True)[-1])


def test_a_block_gone_since_the_plan_is_failed_precondition(workers: WorkerClient) -> None:
    with pytest.raises(FailedPrecondition, match="block 0"):
        workers.run(tokens_of(11, 40), plan("bounded-replay", fetch=32, resume=32, replay_start=24))


def test_a_snapshot_gone_since_the_plan_is_failed_precondition(workers: WorkerClient, store: Client) -> None:
    prompt = tokens_of(12, 40)
    workers.run(prompt, None)
    store.swa.delete_many(store.swa.keys(prompt, [32]))
    with pytest.raises(FailedPrecondition, match="snapshot at 32"):
        workers.run(prompt, plan("fetch+snapshot", fetch=32, position=32, resume=32))


def test_the_plan_lease_is_released_once_fetched(workers: WorkerClient, store: Client) -> None:
    prompt = tokens_of(13, 40)
    workers.run(prompt, None)
    found = store.lookup(prompt, lease_ms=60_000)
    assert found.lease_id and store.stats().active_leases == 1
    workers.run(prompt, plan("fetch+snapshot", fetch=32, position=32, resume=32, lease_id=found.lease_id))
    assert store.stats().active_leases == 0


def test_runs_of_a_tenant_stay_in_its_namespace(workers: WorkerClient, server: Any) -> None:
    prompt = tokens_of(14, 40)
    workers.run(prompt, None, namespace="alice")
    with Client(server.target, namespace="alice", geometry=TINY.name) as alice, \
            Client(server.target, namespace="bob", geometry=TINY.name) as bob:
        assert alice.lookup(prompt).found_tokens == 32
        assert bob.lookup(prompt).found_tokens == 0


def test_a_store_outage_costs_the_stores_not_the_answer(workers: WorkerClient, server: Any, loop_thread: Any,
                                                        model: Any) -> None:
    workers.info()
    loop_thread.run(server.stop(0))  # the kvstore server goes away; the worker's connection stays
    prompt = tokens_of(15, 40)
    run = workers.run(prompt, None)
    assert torch.equal(run.logits, from_scratch(model, prompt))
    assert run.store_error.startswith("Unavailable") and run.blocks_stored == 0 and run.snapshot_positions == []
