"""One small retry policy for the clients: capped, jittered exponential backoff over `retryable` errors.

In the style of redis-py's `Retry(backoff, retries)`: the policy is an object the
client is given, not a loop written at each call. It reads the `retryable` flag
of `kvstore.errors` classes, and retries only the classes it `supports` among
them: by default `Unavailable` (the node or the channel is away now), not
`ResourceExhausted` (retryable too, but its wait is hours: a store full of
blocks under retention) nor `DeadlineExceeded` (the call already spent its
whole deadline). The sleep and the random source are injected, so tests move
time instead of waiting (docs/FLEET.md, "Data path").

Where it is used: the fleet client's failover (each round asks every replica
once, then backs off before the next round) and the single-server client's
calls that are safe to repeat (a Lookup without a lease, Stats): see
`kvstore.client.store.Client`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable

T = TypeVar("T")

#: The errors a call is retried on by default: the service away now, back in a moment.
TRANSIENT: tuple[type[KVStoreError], ...] = (Unavailable,)


@dataclass(frozen=True, kw_only=True)
class ExponentialBackoff:
    """Full-jitter exponential backoff: before retry n (1, 2, ...), a uniform wait in [0, min(cap, base * 2^(n-1))].

    Full jitter (AWS's "Exponential Backoff And Jitter") spreads the clients that failed
    together over the whole window, so they do not come back in step.
    """

    #: The first retry's longest wait.
    base_s: float = 0.05
    #: No wait is longer than this, however many retries.
    cap_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and self.cap_s >= self.base_s):
            raise InvalidArgument(f"a backoff needs 0 <= base_s <= cap_s, got {self.base_s}, {self.cap_s}")

    def ceiling_s(self, retry: int) -> float:
        """The longest wait before retry `retry` (1 = the first)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(retry - 1, 64))

    def delay_s(self, retry: int, uniform: Callable[[], float]) -> float:
        """The wait before retry `retry`: `uniform()` (in [0, 1)) of its ceiling."""
        return uniform() * self.ceiling_s(retry)


class Retry:
    """Run a call again on a retryable error, after a backoff, at most `retries` more times.

    Args:
        backoff: the waits between attempts.
        retries: attempts after the first (0: never retry).
        supported: the error classes retried (among those whose `retryable` is true).
        sleep: how to wait (injected in tests).
        uniform: the random source of the jitter, in [0, 1).
    """

    def __init__(self, backoff: ExponentialBackoff | None = None, retries: int = 3, *,
                 supported: tuple[type[KVStoreError], ...] = TRANSIENT,
                 sleep: Callable[[float], None] = time.sleep,
                 uniform: Callable[[], float] = random.random) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidArgument(f"retries must be an int >= 0, got {retries!r}")
        self.backoff = backoff or ExponentialBackoff()
        self.retries = retries
        self.supported = supported
        self.sleep = sleep
        self.uniform = uniform

    def retries_on(self, error: KVStoreError) -> bool:
        """Whether `error` is worth another attempt under this policy."""
        return error.retryable and isinstance(error, self.supported)

    def pause(self, retry: int) -> None:
        """Wait the backoff before retry `retry` (1 = the first): for loops `call` cannot wrap (a stream)."""
        self.sleep(self.backoff.delay_s(retry, self.uniform))

    def call(self, attempt: Callable[[], T]) -> T:
        """`attempt()`'s result, retried after a backoff while it raises a supported retryable error.

        Raises:
            KVStoreError: the last attempt's error (or the first that is not retried).
        """
        retry = 0
        while True:
            try:
                return attempt()
            except KVStoreError as exc:
                if retry >= self.retries or not self.retries_on(exc):
                    raise
                retry += 1
                self.pause(retry)


#: Never retries: for calls that must not run twice.
NO_RETRY = Retry(retries=0)
