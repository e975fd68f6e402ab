"""The ring thread's readied requests (`NativeRing.ready` / `take`, docs/TRANSFER.md "The request
ring"): while no request is there, the thread holds a read txn, the region table and the due time
for the next one. Each test keeps the thread in its spin (a long `SERVER_SPIN_S`) so that what it
readied is what the next request meets, on an in-process server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.transfer import DONE
from tests.gateway.test_transfer_ring import stored
from tests.gateway.test_transfer_ring_native import needs_native, ring_server
from tests.waiting import wait_until
from tiers import ring as native_ring


def readied(served: Any) -> None:
    """Until the ring thread has readied the next request and spins in `take` with it (observed: a
    `take` begun and not returned; a fetch's answer comes after its own `take` returned)."""
    native = served.native
    wait_until(lambda: native._txn is not None and native.takes > native.taken,  # what it readied is the point
               "the ring thread never readied a request and spun on it")


@contextlib.contextmanager
def hot_ring(server: Any, monkeypatch: pytest.MonkeyPatch,
             spin_s: float) -> Iterator[tuple[Any, list[bytes], Any, Any]]:
    """A session with one block stored, a region for it and its ring's server, which spins for
    `spin_s` and keeps what it readied for a minute (so only the spin's end or a waiting ring
    gives it back): (session, hashes, region, served)."""
    from gateway import transfer_ring_native

    monkeypatch.setattr(native_ring, "SERVER_SPIN_S", spin_s)
    monkeypatch.setattr(transfer_ring_native, "_KEEP_S", 60.0)
    with Client(server.target) as client, client.transfer() as session:
        hashes, _ = stored(client, 1)
        region = session.register(client.block_bytes)
        served = ring_server(server, session)
        assert served.native is not None and served.native.ctx.slots is not None
        yield session, hashes, region, served


@needs_native
def test_a_block_purged_after_the_txn_was_readied_is_not_served_from_it(server: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_ring, "SERVER_SPIN_S", 5.0)
    with Client(server.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 2)
        region = session.register(2 * client.block_bytes)
        served = ring_server(server, session)
        assert served.native is not None
        assert session.fetch(hashes, region).done_prefix == 2
        readied(served)
        assert server.tier.purge(served.session.scope, hashes[1:]) == 1  # a commit after the txn began
        region.view[:] = bytes(len(region.view))
        state = session.fetch(hashes, region, prefix_only=False)
        assert state.statuses[0] == DONE and state.statuses[1] != DONE, "the purged block is gone"
        assert bytes(region.view[: client.block_bytes]) == blocks[0]
        assert bytes(region.view[client.block_bytes:]) == bytes(client.block_bytes)
        assert served.native.answered == 1, "the stale txn's request went the fresh way"


@needs_native
def test_a_clock_step_after_ready_judges_the_due_refresh_anew(server: Any, clock: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # A block read 71 h after it was stored is due a durable refresh: the Python read does it. Judged
    # with the due time readied before the clock stepped, the native server would answer it itself.
    monkeypatch.setattr(native_ring, "SERVER_SPIN_S", 5.0)
    with Client(server.target) as client, client.transfer() as session:
        hashes, _ = stored(client, 1)
        region = session.register(client.block_bytes)
        served = ring_server(server, session)
        assert served.native is not None
        assert session.fetch(hashes, region).done_prefix == 1
        readied(served)
        answered = served.native.answered
        clock.advance(71 * 3600.0)
        assert session.fetch(hashes, region).done_prefix == 1
        assert served.native.answered == answered, "due a refresh: answered by the Python read, not natively"
        assert session.ring is not None and session.ring.answered == 2


@needs_native
def test_a_region_registered_while_the_thread_spins_is_served_natively(server: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread readied its region table before the region existed: the request naming it is
    # handed back by `take`, then served afresh natively (not by the Python read).
    with hot_ring(server, monkeypatch, 5.0) as (session, hashes, region, served):
        assert session.fetch(hashes, region).done_prefix == 1
        readied(served)
        answered = served.native.answered
        later = session.register(session.connection.block_bytes)
        assert served.native.regions_moved(), "the spinning thread's table lacks the new region"
        assert session.fetch(hashes, later).done_prefix == 1
        assert bytes(later.view) == bytes(region.view)
        assert served.native.answered == answered + 1, "answered natively, with the new table"
        assert not served.native.regions_moved()


@needs_native
def test_a_ring_asked_again_at_once_keeps_its_txn_and_one_gone_idle_gives_it_back(
        server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with hot_ring(server, monkeypatch, 5.0) as (session, hashes, region, served):
        slots = served.native.ctx.slots
        free: int = slots._initial_value  # type: ignore[attr-defined]  # its counts are what is checked
        for _ in range(50):  # a write the server commits meanwhile (a refresh, a flush) makes a txn stale
            readied(served)
            txn, answered = served.native._txn, served.native.answered
            assert session.fetch(hashes, region).done_prefix == 1
            if served.native.answered == answered + 1:  # answered from what was readied
                break
        else:
            pytest.fail("no request was answered natively")
        readied(served)  # the thread is back in its spin: with what it readied anew, had it not kept it
        assert served.native._txn is txn, "kept across the requests"
        assert slots._value == free - 1, "one reader slot held while the ring is hot"
        monkeypatch.setattr(native_ring, "SERVER_SPIN_S", 0.0)
        wait_until(lambda: served.native._txn is None and slots._value == free,  # the 5 s spin ends: given back
                   "an idle ring kept its txn or its reader slot")


@needs_native
def test_a_hot_ring_gives_its_reader_slot_back_while_another_ring_waits_for_one(
        server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spin outlasts the wait below: only `waiting` frees the slot.
    with hot_ring(server, monkeypatch, 60.0) as (session, hashes, region, served):
        ctx, slots = served.native.ctx, served.native.ctx.slots
        free: int = slots._initial_value  # type: ignore[attr-defined]  # its counts are what is checked
        assert session.fetch(hashes, region).done_prefix == 1
        readied(served)
        with ctx.waiting_lock:
            ctx.waiting += 1  # as `take_slot` counts a ring waiting for a slot
        try:
            assert session.fetch(hashes, region).done_prefix == 1  # answered, then the slot is given back
            wait_until(lambda: slots._value == free,  # type: ignore[attr-defined]
                       "the hot ring kept its slot while another waited")
            assert served.native._txn is None
            assert session.fetch(hashes, region).done_prefix == 1  # served the long way meanwhile
        finally:
            with ctx.waiting_lock:
                ctx.waiting -= 1
