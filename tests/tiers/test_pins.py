"""Pins: a prefix kept until a given time beyond its tenant's retention (docs/RETENTION.md R22-R27).

Real LMDB in a temp dir; time moves by the injected clock.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.clock import ManualClock
from kvstore.errors import ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from tests.tiers.conftest import HOUR, KIT_BLOCK, Kit
from tiers.pins import PinLimits

LIMITS = PinLimits(max_s=200 * HOUR, budget_bytes=8 * KIT_BLOCK)


def _pinning(kit: Kit, limits: PinLimits = LIMITS) -> Kit:
    kit.tier.set_pin_limits_provider(lambda namespace: limits)
    return kit


def _put(kit: Kit, hashes: list[bytes], keep_until_s: float | None = None) -> object:
    r = kit.tier.put(kit.scope, kit.root, hashes, [kit.data(i) for i in range(len(hashes))], True,
                     keep_until_s=keep_until_s)
    return r.pin


def test_r22_a_puts_pin_commits_with_its_blocks_and_survives_a_restart(make_kit: Callable[..., Kit],
                                                                        clock: ManualClock) -> None:
    kit = _pinning(make_kit(10))
    a = kit.chain(0, 3)
    grant = _put(kit, a, keep_until_s=clock.now() + 100 * HOUR)
    assert grant is not None and grant.until_s == clock.now() + 100 * HOUR and grant.why == ""  # type: ignore[attr-defined]
    with pytest.raises(ResourceExhausted):  # refused: nothing stored, so no pin either
        _put(kit, kit.chain(9000, 11), keep_until_s=clock.now() + HOUR)
    kit.tier.close()
    kit = _pinning(make_kit(10))
    totals, live = kit.tier.pins_of("default")
    assert [p.key for p in live] == [kit.scope.key(a[-1])] and totals.charged_bytes == 3 * KIT_BLOCK


def test_r23_a_pinned_prefix_outlives_its_retention_until_its_time(make_kit: Callable[..., Kit],
                                                                   clock: ManualClock) -> None:
    kit = _pinning(make_kit(10))
    pinned = kit.chain(0, 4)
    _put(kit, pinned, keep_until_s=clock.now() + 150 * HOUR)
    clock.advance(1)
    other = kit.chain(5000, 4)
    _put(kit, other)
    clock.advance(100 * HOUR)  # both past the 72-hour retention; the pinned chain is the older
    newer = kit.chain(9000, 4)
    _put(kit, newer)  # needs 2 blocks' room: they come from the unpinned chain
    assert kit.stored(pinned) == [True] * 4  # R6: the pin on the last block keeps the whole prefix
    assert kit.stored(other)[:2] == [True, True] and kit.stored(other)[2:] == [False, False]
    with pytest.raises(ResourceExhausted):  # full, and what is left past retention is pinned or a parent
        _put(kit, kit.chain(12000, 10))
    assert kit.stored(pinned) == [True] * 4


def test_r24_a_pin_is_granted_within_the_tenants_limits(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = _pinning(make_kit(40))
    now = clock.now()
    capped = _put(kit, kit.chain(0, 2), keep_until_s=now + 1000 * HOUR)
    assert capped.until_s == now + 200 * HOUR and "200 h" in capped.why  # type: ignore[attr-defined]
    big = kit.chain(100, 7)
    over = _put(kit, big, keep_until_s=now + HOUR)  # 2 + 7 blocks > the 8-block budget
    assert over.until_s == 0 and "budget" in over.why  # type: ignore[attr-defined]
    assert kit.tier.pin(kit.scope, big[5], now + HOUR).until_s > 0  # a shorter prefix of it fits (2 + 6)
    assert "not stored" in kit.tier.pin(kit.scope, kit.chain(777, 1)[0], now + HOUR).why
    assert "future" in kit.tier.pin(kit.scope, big[0], now - 1).why
    again = kit.tier.pin(kit.scope, big[5], now + 2 * HOUR)  # the same block again: later time, charged once
    assert again.until_s == now + 2 * HOUR and kit.tier.pins_of("default")[0].charged_bytes == 8 * KIT_BLOCK
    stranger = BlockScope(V4_1_FLASH.fingerprint, "stranger")
    kit.tier.set_pin_limits_provider(lambda ns: LIMITS if ns == "default" else PinLimits())
    kit.tier.put(stranger, kit.root, kit.chain(0, 1), [kit.data(0)], True)
    assert "may not pin" in kit.tier.pin(stranger, kit.chain(0, 1)[0], now + HOUR).why


def test_r25_a_pin_expires_by_itself(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = _pinning(make_kit(12))
    pinned = kit.chain(0, 4)
    _put(kit, pinned, keep_until_s=clock.now() + 80 * HOUR)
    clock.advance(1)
    _put(kit, kit.chain(5000, 4))
    clock.advance(81 * HOUR)  # past retention and past the pin
    assert kit.tier.pins_of("default")[0].pins == 0  # a pin past its time is not shown as live
    _put(kit, kit.chain(7000, 1))  # room enough: nothing evicted, but the Put sweeps
    with kit.tier.env.begin() as txn:  # its records are gone but the expiry's journal, until audited (R29)
        assert [bytes(k)[:1] for k in txn.cursor(db=kit.tier._dbs.pins).iternext(values=False)] == [b"x"]
    kit.tier.forget_expired_pins([p for _, p in kit.tier.expired_pins()])
    with kit.tier.env.begin() as txn:
        assert txn.cursor(db=kit.tier._dbs.pins).first() is False
    _put(kit, kit.chain(9000, 4))
    assert kit.stored(pinned)[3:] == [False]  # the oldest go first again


def test_r26_a_purged_block_takes_its_pin_and_frees_the_budget(make_kit: Callable[..., Kit],
                                                               clock: ManualClock) -> None:
    kit = _pinning(make_kit(40))
    a = kit.chain(0, 8)
    _put(kit, a, keep_until_s=clock.now() + HOUR)
    assert kit.tier.pins_of("default")[0].charged_bytes == 8 * KIT_BLOCK
    kit.tier.purge(kit.scope, [a[4]])  # R20: a purge is the operator's, and a pin does not stop it
    assert kit.tier.pins_of("default")[0].pins == 0
    assert kit.tier.pin(kit.scope, a[3], clock.now() + HOUR).until_s > 0  # the budget is free again


def test_r27_an_operator_sees_and_drops_a_tenants_pins(make_kit: Callable[..., Kit], clock: ManualClock) -> None:
    kit = _pinning(make_kit(40))
    a, b = kit.chain(0, 2), kit.chain(100, 3)
    _put(kit, a, keep_until_s=clock.now() + HOUR)
    _put(kit, b, keep_until_s=clock.now() + 2 * HOUR)
    totals, live = kit.tier.pins_of("default")
    assert (totals.pins, totals.charged_bytes) == (2, 5 * KIT_BLOCK)
    assert sorted(p.until_s for p in live) == [clock.now() + HOUR, clock.now() + 2 * HOUR]
    assert kit.tier.pins_of("someone-else")[0].pins == 0
    assert kit.tier.drop_pins("default") == 2
    assert kit.tier.pins_of("default")[0].pins == 0


def test_r29_an_expiry_is_journalled_until_audited_and_survives_a_restart(make_kit: Callable[..., Kit],
                                                                         clock: ManualClock) -> None:
    kit = _pinning(make_kit(12))
    a, b = kit.chain(0, 2), kit.chain(100, 3)
    _put(kit, a, keep_until_s=clock.now() + HOUR)
    _put(kit, b, keep_until_s=clock.now() + 2 * HOUR)
    assert kit.tier.expired_pins() == []  # none due: a read alone
    clock.advance(HOUR + 1)
    first = kit.tier.expired_pins()  # the sweep journals the expiry; not forgotten yet
    assert [(ns, p.key[-32:], p.until_s, p.charged_bytes) for ns, p in first] == [
        ("default", a[-1], clock.now() - 1, 2 * KIT_BLOCK)]
    kit.tier.close()  # a stop before the audit: the journal keeps it
    kit = _pinning(make_kit(12))
    again = kit.tier.expired_pins()
    assert [p.key for _, p in again] == [p.key for _, p in first]
    kit.tier.forget_expired_pins([p for _, p in again])
    assert kit.tier.expired_pins() == []
    clock.advance(HOUR)
    _put(kit, kit.chain(7000, 1))  # a Put's sweep journals the second expiry too
    assert [(p.key[-32:], p.charged_bytes) for _, p in kit.tier.expired_pins()] == [(b[-1], 3 * KIT_BLOCK)]


def test_r29_every_expiry_is_audited_when_more_than_a_sweep_expire_at_once(make_kit: Callable[..., Kit],
                                                                           clock: ManualClock) -> None:
    from tiers.pins import SWEEP_MAX

    n = SWEEP_MAX + 44
    kit = _pinning(make_kit(n), PinLimits(max_s=200 * HOUR, budget_bytes=2 * n * KIT_BLOCK))
    chains = [kit.chain(10_000 + i, 1) for i in range(n)]  # n one-block prompts, each pinned for an hour
    for chain in chains:
        _put(kit, chain, keep_until_s=clock.now() + HOUR)
    clock.advance(73 * HOUR)  # every pin expired at once, every block past retention
    # A Put that needs every block's room: its sweep takes SWEEP_MAX expiries, its eviction the rest's blocks.
    kit.tier.put(kit.scope, kit.root, kit.chain(1, n), [kit.data(i) for i in range(n)], True)
    assert not any(s for chain in chains for s in kit.stored(chain))
    audited: list[bytes] = []
    for _ in range(3):  # as the server's pass: at most SWEEP_MAX a pass, the rest the next
        gone = kit.tier.expired_pins()
        assert len(gone) <= SWEEP_MAX
        audited += [p.key for _, p in gone]
        kit.tier.forget_expired_pins([p for _, p in gone])
    assert sorted(audited) == sorted(kit.scope.key(chain[-1]) for chain in chains)  # each expiry, once
    assert kit.tier.pins_of("default")[0].pins == 0
