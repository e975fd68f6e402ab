"""`tiers.ring.take` (the ring thread's spin and a request's first half in one native call, with a
txn readied before the request came), `kvstore.native.ring.ask_slots` (the client's request written from a
list of hashes) and the awake words that let either side skip a futex wake, against a real LMDB
tier as in test_blockcopy_ring.py."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.native import ring as shared
from kvstore.transfer_ring import ANSWERED, BUSY, CLOSED, HEADER_AT, IDLE, REQUEST, REQUEST_AT, REQUEST_BYTES
from tests.tiers.conftest import Kit
from tests.tiers.test_blockcopy_ring import BLOCK, REGION_ID, Rig, _address, read
from tests.tiers.test_blockcopy_ring import rig as _rig  # noqa: F401  # the fixture
from tiers import ring

pytestmark = pytest.mark.skipif(not ring.NATIVE, reason="kvstore.native._ring is not built (no C compiler at install)")

FAR = time.monotonic() + 3600.0  # a lease that has not ended


@pytest.fixture
def rig(_rig: Rig) -> Iterator[Rig]:  # noqa: F811
    yield _rig


def take(rig: Rig, raw: bytes | None, txn: Any, *, expires: float = FAR, spin_s: float = 0.0, seq: int = 11,
         length: int | None = None, expected: int = ANSWERED) -> tuple[int, int, int, Any]:
    """One `take` with `raw` written as the client writes it (state REQUEST), or none."""
    h = rig.header
    h.state = expected
    if raw is not None:
        rig.ring_map[REQUEST_AT:REQUEST_AT + len(raw)] = raw
        h.seq, h.length, h.state = seq, len(raw) if length is None else length, REQUEST
    return ring.take(_address(rig.ring_map), expected, 0.0, spin_s, expires, rig.table(), BLOCK, 128,
                     rig.kit.scope.prefix, rig.mapping, txn, 0.0, bytearray(16 * 128))


def test_a_plain_request_is_planned_with_busy_stored_and_nothing_copied(rig: Rig) -> None:
    raw = read(rig.hashes[:2], [BLOCK, 0])
    with rig.kit.tier.env.begin() as txn:
        assert take(rig, raw, txn) == (ring.PLANNED, 11, len(raw), 2)
    assert rig.header.state == BUSY and rig.header.server_awake == 0
    assert rig.region[:] == bytes(len(rig.region)), "take copies nothing: finish does, once the read is counted"


def test_no_request_within_the_spin_is_idle_with_the_words_value(rig: Rig) -> None:
    with rig.kit.tier.env.begin() as txn:
        assert take(rig, None, txn, spin_s=0.001) == (ring.IDLE, 0, 0, ANSWERED)
        rig.header.state = CLOSED  # another value than the one waited on ends the spin too
        assert ring.take(_address(rig.ring_map), IDLE, 0.0, 5.0, FAR, rig.table(), BLOCK, 128, rig.kit.scope.prefix,
                         rig.mapping, txn, 0.0, bytearray(16 * 128))[::3] == (ring.IDLE, CLOSED)
    assert rig.header.server_awake == 0, "cleared before the caller may sleep"


def test_a_write_committed_after_the_txn_began_makes_the_request_stale(rig: Rig) -> None:
    raw = read(rig.hashes[:1], [0])
    txn = rig.kit.tier.env.begin()
    try:
        more = Kit.chain(100, 1)
        rig.kit.tier.put(rig.kit.scope, Kit.root, more, [os.urandom(BLOCK)], True)
        assert take(rig, raw, txn)[:3] == (ring.STALE, 11, len(raw))
    finally:
        txn.abort()
    with rig.kit.tier.env.begin() as fresh:  # the newest snapshot again: planned
        assert take(rig, raw, fresh)[0] == ring.PLANNED


def test_a_length_past_the_request_area_or_an_ended_lease_is_left_to_the_caller(rig: Rig) -> None:
    raw = read(rig.hashes[:1], [0])
    with rig.kit.tier.env.begin() as txn:
        assert take(rig, raw, txn, length=REQUEST_BYTES + 1) == (ring.CHECK, 11, REQUEST_BYTES + 1, 0)
        assert take(rig, raw, txn, expires=time.monotonic() - 1.0) == (ring.CHECK, 11, len(raw), 0)


def test_more_than_plan_most_descriptors_is_large_and_nothing_is_read(rig: Rig) -> None:
    raw = read([rig.hashes[0]] * (ring.PLAN_MOST + 1), [0] * (ring.PLAN_MOST + 1))
    with rig.kit.tier.env.begin() as txn:
        assert take(rig, raw, txn) == (ring.LARGE, 11, len(raw), 0)


def test_a_miss_is_handed_back_with_the_bytes_as_read(rig: Rig) -> None:
    raw = read([rig.hashes[0], b"\x09" * 32], [0, BLOCK])
    with rig.kit.tier.env.begin() as txn:
        assert take(rig, raw, txn) == (ring.HANDED_BACK, 11, len(raw), raw)
        other = read(rig.hashes[:1], [0], region_id=REGION_ID + 1)  # not the session's region: handed back too
        assert take(rig, other, txn)[0] == ring.HANDED_BACK


def test_take_refuses_bad_arguments(rig: Rig) -> None:
    with rig.kit.tier.env.begin() as txn, pytest.raises(ValueError):
        ring.take(_address(rig.ring_map), REQUEST, 0.0, 0.0, FAR, rig.table(), BLOCK, 128, rig.kit.scope.prefix,
                  rig.mapping, txn, 0.0, bytearray(16 * 128))
    with rig.kit.tier.env.begin() as txn, pytest.raises(ValueError):
        ring.take(_address(rig.ring_map), IDLE, 0.0, 0.0, FAR, rig.table(), BLOCK, 128, rig.kit.scope.prefix,
                  rig.mapping, txn, 0.0, bytearray(16))  # a plan too short for the limit


def test_ask_slots_writes_what_ask_writes_and_refuses_anything_but_whole_bytes(rig: Rig) -> None:
    address = _address(rig.ring_map)
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert shared.ask_slots(address, b"head", hashes, b"tail", 4, 0.0, 0.0, b"") == shared.ASKED_NONE
    want = b"head" + b"".join(hashes) + b"tail"
    h = rig.header
    assert rig.ring_map[REQUEST_AT:REQUEST_AT + len(want)] == want
    assert (h.state, h.seq, h.length, h.client_awake) == (REQUEST, 4, len(want), 0)
    h.state = ANSWERED
    for bad in ([*hashes[:2], bytearray(32)], [*hashes[:2], b"x" * 31], [hashes[0], "x" * 32], tuple(hashes),
                [b"x" * 32] * (REQUEST_BYTES // 32)):
        assert shared.ask_slots(address, b"head", bad, b"tail", 5, 0.0, 0.0, b"") == -1
        assert (h.state, h.seq) == (ANSWERED, 4), "nothing was asked"


def _syscall_of(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return f.read().split()[0]


def _futex_wait(word: int, expected: int, timeout_s: float) -> int:
    """FUTEX_WAIT (shared) on the u32 at `word`: 0 woken, else the errno (ETIMEDOUT 110, EAGAIN 11)."""
    libc = ctypes.CDLL(None, use_errno=True)
    spec = (ctypes.c_long * 2)(int(timeout_s), int((timeout_s % 1) * 1e9))
    rc = libc.syscall(ctypes.c_long(202), ctypes.c_void_p(word), ctypes.c_int(0), ctypes.c_uint32(expected),
                      ctypes.byref(spec), None, ctypes.c_int(0))
    return 0 if rc == 0 else ctypes.get_errno()


@pytest.mark.parametrize("awake", [0, 1])
def test_finish_wakes_a_sleeping_client_unless_it_says_it_is_awake(rig: Rig, awake: int) -> None:
    raw = read(rig.hashes[:1], [0])
    plan = bytearray(16 * 128)
    with rig.kit.tier.env.begin() as txn:
        rig.ring_map[REQUEST_AT:REQUEST_AT + len(raw)] = raw
        assert ring.serve(_address(rig.ring_map), 3, len(raw), rig.table(), BLOCK, 128, rig.kit.scope.prefix,
                          rig.mapping, txn, 0.0, plan) == (ring.PLANNED, 1)
        h = rig.header
        h.state, h.client_awake = BUSY, awake
        got = [_asleep_then(_address(rig.ring_map) + HEADER_AT, BUSY,
                            lambda: ring.finish(_address(rig.ring_map), 3, plan, 1, BLOCK))]
    assert h.state == ANSWERED and rig.region[:BLOCK] == rig.blocks[rig.hashes[0]]
    assert got == ([110] if awake else [0]), "a client that said it spins is not woken; one asleep is"


def _asleep_then(word: int, expected: int, act: Any) -> int:
    """FUTEX_WAIT on a thread; `act()` once it sleeps there; the wait's result (0 woken, 110 timed out)."""
    got: list[int] = []
    tids: list[int] = []

    def sleeper() -> None:
        tids.append(threading.get_native_id())
        got.append(_futex_wait(word, expected, 2.0))

    thread = threading.Thread(target=sleeper)
    thread.start()
    while not tids or _syscall_of(tids[0]) != "202":  # asleep in the futex before the store
        time.sleep(0.001)
    act()
    thread.join()
    return got[0]


@pytest.mark.parametrize(("awake", "want"), [(0, 0), (1, 110)])
def test_a_sleeping_server_is_woken_by_ask_and_a_spinning_one_is_not(rig: Rig, awake: int, want: int) -> None:
    address = _address(rig.ring_map)
    h = rig.header
    h.state, h.server_awake = ANSWERED, awake
    got = _asleep_then(address + HEADER_AT, ANSWERED,
                       lambda: shared.ask(address, b"req", 1, 0.0, 0.0, b""))
    assert got == want and h.state == REQUEST
