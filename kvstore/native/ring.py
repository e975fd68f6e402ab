"""The request ring's native half that both ends share (`kvstore.native._ring`): waiting on a word,
publishing one, and the client's ask.

A ring is a shared-memory region a client and the server take turns on (docs/TRANSFER.md). The
client writes a request and spins for its answer (`ask`, `ask_slots`); the server's ring thread
waits for requests (`wait`) and wakes the client (`publish`). These need nothing of the store, so the
worker side imports them from here; the server's work on a request, which reads the LMDB tier's
pages, is `tiers.ring`'s. `NATIVE` says whether the module was built (no C compiler at install: the
Python forms in `kvstore.client.transfer_ring` and `gateway.transfer_ring` stand in).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def _load() -> ModuleType | None:
    try:
        from kvstore.native import _ring  # type: ignore[attr-defined]  # a C module: no stub
    except ImportError:  # not built (no C compiler at install): the Python forms stand in
        return None
    return _ring


#: The built module itself, or None; `tiers.ring` calls its server functions.
native: ModuleType | None = _load()
#: True when the ring's native module is built.
NATIVE = native is not None

#: `ask`'s answers: no answer within the spin (sleep on the futex), an answer (read it), or an
#: answer that is exactly the expected bytes with code 0.
ASKED_NONE, ASKED, ASKED_EXPECTED = 0, 1, 2

#: `ask_slots` itself (a stand-in answering -1 where not built): `ask` of `head + b"".join(hashes) + tail`,
#: the list checked (every item `bytes` of 32) and written into the ring natively; -1, nothing sent, when
#: it is not so. Bound here without a wrapper: it is the client's hot path (`kvstore.client.transfer_ring`).
ask_slots: Callable[..., int] = (lambda *_: -1) if native is None else native.ask_slots


def wait(address: int, expected: int, hot_s: float, spin_s: float, timeout_s: float, peer_cpu: int = 0) -> int:
    """The 32-bit word at `address` once it no longer holds `expected` (or after `timeout_s`),
    without the GIL: spinning on it for `hot_s` (none when the u32 at `peer_cpu`, 1 + the CPU
    the peer last ran on, names this thread's CPU), then yielding the core between looks until
    `spin_s`, then sleeping on its futex. The caller keeps the words' mapping alive across the call."""
    assert native is not None
    result: int = native.wait(address, expected, hot_s, spin_s, timeout_s, peer_cpu)
    return result


def publish(address: int, value: int) -> None:
    """Store `value` in the 32-bit word at `address`, after every store before it, and wake its waiters."""
    assert native is not None
    native.publish(address, value)


def ask(ring: int, request: bytes, seq: int, hot_s: float, spin_s: float, expected: bytes) -> int:
    """The client's side of one ring request, without the GIL: copy `request` into the ring at
    `ring` (its mapping kept alive, its one slot held by the caller), write the header words,
    set REQUEST, wake the server, then spin for answer `seq` (`hot_s` without yielding, unless
    the server last ran on this CPU, then yielding until `spin_s`).

    Returns:
        ASKED_NONE (no answer yet: wait on the futex), ASKED (answered: read it) or
        ASKED_EXPECTED (answered with code 0 and exactly `expected`).
    """
    assert native is not None
    result: int = native.ask(ring, request, seq, hot_s, spin_s, expected)
    return result
