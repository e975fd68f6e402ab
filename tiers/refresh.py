"""Group commit of retention refreshes: uses (Get, Lookup, transfer reads) recorded in shared commits.

Reads come in many small batches; one fsync'd write transaction per batch
would queue them all behind LMDB's single writer. Keys that arrive while a
commit runs are merged into the next one, and every caller's future resolves
when the commit holding its keys is durable (or fails with its error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future


class RefreshBatcher:
    """Queues keys to refresh and commits them in groups on `executor`.

    Args:
        executor: where the commit runs (the tier's pool).
        touch: records a use of the given keys, durably (one commit).
    """

    def __init__(self, executor: Executor, touch: Callable[[Iterable[bytes]], None]) -> None:
        self._executor = executor
        self._touch = touch
        self._lock = threading.Lock()
        self._pending: set[bytes] = set()
        self._future: Future[None] = Future()
        self._scheduled = False

    def submit(self, keys: Sequence[bytes]) -> Future[None]:
        """Queue `keys` for the next group commit; the future resolves once it is durable."""
        with self._lock:
            self._pending.update(keys)
            future = self._future
            if not self._scheduled:
                self._scheduled = True
                self._executor.submit(self._flush)
        return future

    def _flush(self) -> None:
        with self._lock:
            keys, self._pending = self._pending, set()
            future, self._future = self._future, Future()
            self._scheduled = False
        try:
            self._touch(keys)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
