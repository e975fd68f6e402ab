"""The retry policy (kvstore.client.retry): capped, jittered backoff over retryable errors, time injected."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.client import Client
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unavailable


def failing(errors: list[KVStoreError], result: str = "ok") -> Any:
    """A call that raises each of `errors` in turn, then returns `result`; it counts its calls."""
    def call() -> str:
        call.calls += 1  # type: ignore[attr-defined]
        if errors:
            raise errors.pop(0)
        return result
    call.calls = 0  # type: ignore[attr-defined]
    return call


def test_f35_backoff_is_capped_and_jittered() -> None:
    """F35: the ceiling doubles from base_s to cap_s and stays; each wait is the random draw times it."""
    backoff = ExponentialBackoff(base_s=0.1, cap_s=0.5)
    assert [backoff.ceiling_s(n) for n in range(1, 7)] == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert backoff.ceiling_s(10_000) == 0.5  # no overflow, however many retries
    sleeps: list[float] = []
    draws = iter([0.0, 0.5, 0.999, 0.25, 0.75])
    retry = Retry(backoff, retries=5, sleep=sleeps.append, uniform=lambda: next(draws))
    call = failing([Unavailable("away")] * 5)
    assert retry.call(call) == "ok" and call.calls == 6
    assert sleeps == pytest.approx([0.0, 0.1, 0.3996, 0.125, 0.375])
    assert all(s <= 0.5 for s in sleeps)


def test_f35_jitter_spreads_clients_that_failed_together() -> None:
    import random

    rng = random.Random(7)
    waits = set()
    for _ in range(50):
        sleeps: list[float] = []
        Retry(ExponentialBackoff(base_s=1.0, cap_s=1.0), retries=1, sleep=sleeps.append,
              uniform=rng.random).call(failing([Unavailable("away")]))
        waits.add(round(sleeps[0], 6))
    assert len(waits) == 50 and min(waits) >= 0 and max(waits) < 1.0


def test_gives_up_after_its_retries_with_the_last_error() -> None:
    sleeps: list[float] = []
    call = failing([Unavailable("one"), Unavailable("two"), Unavailable("three")])
    with pytest.raises(Unavailable, match="three"):
        Retry(retries=2, sleep=sleeps.append).call(call)
    assert call.calls == 3 and len(sleeps) == 2


def test_f35_reads_the_retryable_flag_and_retries_only_what_it_supports() -> None:
    sleeps: list[float] = []
    retry = Retry(retries=3, sleep=sleeps.append)
    for error in (InvalidArgument("bad"), ResourceExhausted("full: its wait is hours")):
        call = failing([error])
        with pytest.raises(type(error)):
            retry.call(call)
        assert call.calls == 1
    assert sleeps == []
    wide = Retry(retries=1, supported=(KVStoreError,), sleep=sleeps.append)
    assert wide.call(failing([ResourceExhausted("full")])) == "ok" and len(sleeps) == 1


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        Retry(retries=-1)
    with pytest.raises(InvalidArgument):
        ExponentialBackoff(base_s=2.0, cap_s=1.0)


def test_f35_the_single_server_client_retries_a_lookup_without_a_lease_only(server: Any, loop_thread: Any) -> None:
    """A Lookup without a lease is safe to repeat; a leased one and a Put are sent once."""
    sleeps: list[float] = []
    client = Client(server.target, retry=Retry(retries=2, sleep=sleeps.append))
    try:
        tokens = list(range(32))
        assert client.lookup(tokens).found_blocks == 0 and sleeps == []
        loop_thread.run(server.stop(0))
        with pytest.raises(Unavailable):
            client.lookup(tokens)
        assert len(sleeps) == 2
        with pytest.raises(Unavailable):
            client.lookup(tokens, lease_ms=1000)
        assert len(sleeps) == 2
        with pytest.raises(Unavailable):
            client.stats()
        assert len(sleeps) == 4
    finally:
        client.close()
