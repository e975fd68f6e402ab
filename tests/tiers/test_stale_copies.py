"""A stale copy's two ends in the store (tiers/stale_copies.py, docs/FLEET.md F79), on a real LMDB tier and a
moved clock: a replica raising its last uses to the asking copy's, and the old holder's drop, which re-reads what
it needs inside its write transaction."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from tests.tiers.conftest import KIT_BLOCK, KIT_TOKENS, Kit
from tiers.lmdb_tier import LmdbBlockTier


def _uses(kit: Kit, hashes: list[bytes]) -> list[float]:
    return [kit.meta(h).last_access_s for h in hashes]


def test_f79_a_replica_raises_each_held_blocks_last_use_never_lowering_it_nor_past_its_now(
        kit: Kit, clock: ManualClock) -> None:
    hashes = kit.chain(0, 4)
    kit.put(hashes)
    t0 = kit.meta(hashes[0]).last_access_s
    clock.advance(100.0)
    absent = kit.scope.key(kit.chain(99, 1)[0])
    keys = kit.keys(hashes)
    said = kit.tier.raise_uses([(keys[0], t0 + 50.0), (keys[1], t0 - 10.0), (absent, t0), (keys[2], t0 + 500.0)])
    assert said == [True, True, False, False]  # raised; held later already; not held; past this node's now
    assert _uses(kit, hashes) == [t0 + 50.0, t0, t0, t0]  # never lowered, never stamped in its future
    assert kit.tier.raise_uses([(keys[0], t0 + 50.0)]) == [True]  # asked again: nothing to write, still true


def test_f79_a_copy_used_here_after_its_replicas_confirmed_it_is_not_dropped(kit: Kit, clock: ManualClock) -> None:
    hashes = kit.chain(0, 4)
    kit.put(hashes)
    keys = kit.keys(hashes)
    confirmed = dict(zip(keys, _uses(kit, hashes), strict=True))
    clock.advance(120.0)
    kit.tier.touch([keys[3]])  # a use after the replicas confirmed: theirs may be older than it now
    window_start = clock.now() - 3600.0
    assert kit.tier.drop_confirmed_run(keys[0], confirmed, window_start) == 0
    assert kit.stored(hashes) == [True] * 4
    confirmed[keys[3]] = kit.meta(hashes[3]).last_access_s  # confirmed again, with that use
    assert kit.tier.drop_confirmed_run(keys[0], confirmed, window_start) == 4 * KIT_BLOCK
    assert kit.stored(hashes) == [False] * 4
    assert (kit.tier.stats().blocks_stored, kit.tier.stats().bytes_stored) == (0, 0)  # the usage follows


def test_f79_a_block_not_confirmed_goes_with_the_copy_only_past_its_window(kit: Kit, clock: ManualClock) -> None:
    hashes = kit.chain(0, 3)
    kit.put(hashes)
    keys = kit.keys(hashes)
    confirmed = dict(zip(keys[:2], _uses(kit, hashes[:2]), strict=True))  # the last block was out of the window
    assert kit.tier.drop_confirmed_run(keys[0], confirmed, kit.meta(hashes[2]).last_access_s) == 0
    assert kit.tier.drop_confirmed_run(keys[0], confirmed, kit.meta(hashes[2]).last_access_s + 1.0) == 3 * KIT_BLOCK


def test_f79_a_leased_or_pinned_copy_is_not_dropped(open_tier: Callable[..., LmdbBlockTier], tmp_path: Path,
                                                   clock: ManualClock) -> None:
    kit = Kit(open_tier(StoreSettings(data_dir=tmp_path / "store", capacity_bytes=10 * KIT_BLOCK,
                                      block_tokens=KIT_TOKENS, pin_max_hours=10.0, pin_budget_bytes=1 << 20)))
    hashes = kit.chain(0, 4)
    kit.put(hashes)
    keys = kit.keys(hashes)
    confirmed = dict(zip(keys, _uses(kit, hashes), strict=True))
    start = clock.now() - 3600.0
    _, lease = kit.tier.lookup(kit.scope, hashes[:2], lease_s=30.0)  # a lease on the run's second block
    assert lease is not None
    assert kit.tier.drop_confirmed_run(keys[0], confirmed, start) == 0
    assert kit.tier.release(lease.lease_id)
    assert kit.tier.pin(kit.scope, hashes[1], clock.now() + 3600.0).until_s > 0  # R22: a pin on it
    assert kit.tier.drop_confirmed_run(keys[0], confirmed, start) == 0
    assert kit.stored(hashes) == [True] * 4


def test_f84_runs_dropped_together_are_one_transaction_and_a_run_kept_keeps_only_itself(
        kit: Kit, clock: ManualClock) -> None:
    """Three runs in one `drop_confirmed_runs`: the one used here since its confirmation stays whole, the other two go,
    in one committed write transaction; asked again with only the kept one, nothing is committed at all."""
    runs = [kit.chain(seed, 2) for seed in (1, 2, 3)]
    for hashes in runs:
        kit.put(hashes)
    confirmed = [dict(zip(kit.keys(h), _uses(kit, h), strict=True)) for h in runs]
    clock.advance(120.0)
    kit.tier.touch([kit.keys(runs[1])[1]])  # used after its replicas confirmed it: kept
    start = clock.now() - 3600.0
    asked = [(kit.keys(h)[0], c, start) for h, c in zip(runs, confirmed, strict=True)]
    before = kit.tier.env.info()["last_txnid"]
    assert kit.tier.drop_confirmed_runs(asked) == [2 * KIT_BLOCK, 0, 2 * KIT_BLOCK]
    assert kit.tier.env.info()["last_txnid"] == before + 1
    assert [kit.stored(h) for h in runs] == [[False] * 2, [True] * 2, [False] * 2]
    assert kit.tier.drop_confirmed_runs([asked[1]]) == [0]
    assert kit.tier.env.info()["last_txnid"] == before + 1  # nothing removed: no commit (no fsync)
